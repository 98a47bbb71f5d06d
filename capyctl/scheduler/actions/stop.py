"""Stop: a model's engine ended and its memory given back.

:func:`stop` is the person's intent ("stop it": desired stopped, then stopped);
:func:`stop_engine` the verb the others use (an eviction that cannot park, a park that
kept its memory); :func:`end_engine_and_fail` ends the engine of a start, wake or park that
went wrong and fails the model.
"""

from __future__ import annotations

import logging
import time

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.events.models import Event
from capyctl.scheduler import deployment_locks, transitions
from capyctl.scheduler.actions.common import STOP_GRACE_SECONDS, instance_key, live_instance, load
from capyctl.scheduler.actions.drain import drain
from capyctl.scheduler.drivers import HostDriver, driver_for
from capyctl.scheduler.errors import EngineFailedError, SchedulerError
from hostagent.errors import EngineStuckError

logger = logging.getLogger("capyctl.scheduler")


def stop(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "stop it": desired stopped, engine ended, memory released."""
    transitions.desired(deployment_id, "stopped")
    deployment = load(deployment_id)
    # A download holds its start's lock for as long as it takes: the stop does not wait.
    if deployment.observed_state == ObservedState.DOWNLOADING and transitions.download_stopped(
        deployment, actor=actor
    ):
        return load(deployment_id)
    return stop_engine(deployment, actor, reason="stopped on request")


def stop_engine(
    deployment: Deployment, actor: str, *, reason: str, level: str = Event.Level.INFO
) -> Deployment:
    """Stop the deployment whatever its state, under its operating lock:

    1. move it to STOPPING (a conditional update, tried again while its state changes);
    2. end its engine process on its host (SIGTERM, then SIGKILL after the grace); one that
       outlives SIGKILL fails the model with its memory still counted;
    3. STOPPED, its ledger entries released (:func:`transitions.stopped`).
    """
    with deployment_locks.operating(deployment.pk, deployment.name):
        started = time.monotonic()
        for _attempt in range(5):
            current = (
                Deployment.objects.filter(pk=deployment.pk)
                .values_list("observed_state", flat=True)
                .first()
            )
            if current is None:
                raise SchedulerError(f"deployment {deployment.pk} no longer exists")
            if current == ObservedState.STOPPED:
                return load(deployment.pk)
            if transitions.stopping(deployment.pk, current):
                break
        else:
            raise SchedulerError(f"could not stop {deployment.name}: its state kept changing")
        deployment = load(deployment.pk)
        instance = live_instance(deployment)
        if instance is not None and deployment.host is not None:
            try:
                driver_for(deployment.host).stop(instance_key(instance), STOP_GRACE_SECONDS)
            except EngineStuckError as exc:
                transitions.failed(
                    deployment,
                    str(exc),
                    actor=actor,
                    expected=[ObservedState.STOPPING],
                    engine_gone=False,
                )
                raise EngineFailedError(f"{deployment.name}: {exc}") from exc
            transitions.instance_exited(instance.pk)
        transitions.stopped(deployment, reason=reason, level=level, started=started, actor=actor)
        return load(deployment.pk)


def drain_and_stop(deployment: Deployment, actor: str, *, reason: str, level: str) -> bool:
    """Drain a ready deployment, then stop it; False: it was no longer ready."""
    with deployment_locks.operating(deployment.pk, deployment.name):
        if not drain(deployment, "stopping"):
            return False
        logger.log(logging.WARNING if level == Event.Level.WARNING else logging.INFO,
                   "%s: %s", deployment.name, reason)  # fmt: skip
        stop_engine(deployment, actor, reason=reason, level=level)
        return True


def end_engine_and_fail(
    deployment: Deployment,
    driver: HostDriver,
    instance: Instance | None,
    reason: str,
    actor: str,
) -> None:
    """End the deployment's engine process, then fail the deployment: a step on a live
    engine went wrong, so the engine goes first. :func:`transitions.failed` then moves the
    state (its memory released with the process gone, or, if the process outlived SIGKILL,
    kept counted); a newer start or wake of it (an engine process other than ``instance``)
    is left alone. Where no engine needs ending, call :func:`transitions.failed` itself."""
    mine = instance.pk if instance is not None else None
    if instance is not None:
        try:
            driver.stop(instance_key(instance), 2.0)
        except EngineStuckError as exc:
            transitions.failed(deployment, f"{reason}; {exc}", actor=actor, engine_gone=False,
                               instance_id=mine)  # fmt: skip
            return
        transitions.instance_exited(instance.pk)
    transitions.failed(deployment, reason, actor=actor, instance_id=mine)
