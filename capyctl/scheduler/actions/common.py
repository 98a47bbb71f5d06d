"""What every verb reads: a deployment's row and its live engine process, and the bounds
they share (:data:`MAX_SWITCH_ROUNDS` is the step's, :mod:`capyctl.scheduler.steps`)."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance
from capyctl.prepared import Prepared, first
from capyctl.scheduler.errors import SchedulerError
from capyctl.scheduler.steps import MAX_SWITCH_ROUNDS

# How long an engine has to end after SIGTERM before it is killed.
STOP_GRACE_SECONDS = 10.0


# Each verb reads these at least once a switch: their SQL is built once (capyctl.prepared).
_DEPLOYMENT = Prepared(
    lambda pk: Deployment.objects.select_related("engine", "host").filter(pk=pk), arity=1
)
_LIVE_INSTANCE = Prepared(
    lambda pk: (
        Instance.objects.filter(deployment_id=pk)
        .exclude(state=Instance.State.EXITED)
        .only("pk", "pid", "port", "gpu_indices", "key", "claim_bytes", "state")[:1]
    ),
    arity=1,
)
_STATES = Prepared(
    lambda pk: Deployment.objects.filter(pk=pk).values_list("observed_state", "desired_state"),
    arity=1,
)


def load(deployment_id: int) -> Deployment:
    """The deployment's row as it is now, with its engine and host."""
    row = first(_DEPLOYMENT(deployment_id))
    if row is None:
        raise SchedulerError(f"deployment {deployment_id} no longer exists")
    return row


def live_instance(deployment: Deployment) -> Instance | None:
    """Its engine process that has not exited (at most one), if any."""
    return first(_LIVE_INSTANCE(deployment.pk))


def states(deployment_id: int) -> tuple[str, str] | None:
    """Its (observed, desired) state as it is now; None when it no longer exists."""
    return first(_STATES(deployment_id))


def instance_key(instance: Instance) -> str:
    """The host's name for an instance's engine process."""
    return instance.key


def touch(deployment_id: int) -> None:
    """Note a request for the deployment (least-recently-used order), at most once a second."""
    now = timezone.now()
    Deployment.objects.filter(pk=deployment_id).exclude(
        last_request_at__gt=now - timedelta(seconds=1)
    ).update(last_request_at=now)


__all__ = [
    "MAX_SWITCH_ROUNDS",
    "STOP_GRACE_SECONDS",
    "instance_key",
    "live_instance",
    "load",
    "states",
    "touch",
]
