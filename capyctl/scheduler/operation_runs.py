"""Carrying out one requested operation (an Operation row saved by the CLI, REST or the
admin): the same work in standalone's scheduler loop (:mod:`capyctl.scheduler.executor`)
and on a Celery worker (:mod:`capyctl.scheduler.tasks`)."""

from __future__ import annotations

import logging

from django.db import close_old_connections, connection
from django.utils import timezone

from capyctl.deployments.models import Deployment
from capyctl.scheduler import actions, errors, restarts
from capyctl.scheduler.models import Operation

logger = logging.getLogger("capyctl.scheduler")


def run_operation(operation_id: int) -> None:
    """Carry out one requested operation (idempotent: only a pending row is taken)."""
    close_old_connections()
    try:
        taken = Operation.objects.filter(pk=operation_id, status=Operation.Status.PENDING).update(
            status=Operation.Status.RUNNING, started_at=timezone.now()
        )
        if not taken:
            return
        op = Operation.objects.select_related("deployment").get(pk=operation_id)
        actor = op.actor or "system"
        try:
            if op.action == Operation.Action.RESTART:
                said = restarts.restart(op.deployment_id, rolling=op.mode == "rolling",
                                        actor=actor)  # fmt: skip
                Operation.objects.filter(pk=op.pk).update(
                    status=Operation.Status.DONE, message=said, finished_at=timezone.now()
                )
                return
            if op.action == Operation.Action.START:
                result = actions.start(op.deployment_id, actor)
            elif op.action == Operation.Action.STOP:
                for replica in _replicas(op.deployment_id, exclude=("stopped",)):
                    actions.stop(replica, actor)
                result = actions.stop(op.deployment_id, actor)
            elif op.action == Operation.Action.PARK:
                for replica in _replicas(op.deployment_id, only=("ready",)):
                    actions.park(replica, op.mode or None, actor=actor)
                result = actions.park(op.deployment_id, op.mode or None, actor=actor)
            else:
                result = actions.ensure_ready(op.deployment_id, actor)
        except errors.SchedulerError as exc:
            Operation.objects.filter(pk=op.pk).update(
                status=Operation.Status.FAILED, message=str(exc), finished_at=timezone.now()
            )
            return
        except Exception as exc:  # an unexpected fault must still answer the requester
            logger.exception("%s of %s failed", op.action, op.deployment.name)
            Operation.objects.filter(pk=op.pk).update(
                status=Operation.Status.FAILED,
                message=f"internal error: {type(exc).__name__}: {exc}",
                finished_at=timezone.now(),
            )
            return
        state = result.observed_state + (f" ({result.parked_mode})" if result.parked_mode else "")
        message = f"{result.name} is {state}"
        if op.action == Operation.Action.PARK and result.observed_state != "parked":
            # Stopped instead (its engine cannot park, its policy says stop...): say why.
            message += ", not parked" + (f": {result.state_reason}" if result.state_reason else "")
        Operation.objects.filter(pk=op.pk).update(
            status=Operation.Status.DONE, message=message, finished_at=timezone.now()
        )
    finally:
        connection.close()


def _replicas(
    deployment_id: int, *, only: tuple[str, ...] = (), exclude: tuple[str, ...] = ()
) -> list[int]:
    """The deployment's replicas beyond the first (a stop or park of a deployment is of
    each of its replicas), in a state of ``only`` and not of ``exclude``."""
    rows = Deployment.objects.filter(replica_of_id=deployment_id).order_by("replica_index")
    if only:
        rows = rows.filter(observed_state__in=only)
    if exclude:
        rows = rows.exclude(observed_state__in=exclude)
    return list(rows.values_list("pk", flat=True))
