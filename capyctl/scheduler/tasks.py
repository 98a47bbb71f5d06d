"""Celery tasks: thin wrappers around the operations. They take ids, are safe to run twice
(operations use conditional transitions) and are acknowledged late, so a worker that dies
mid-task leaves the task to another. Standalone runs the same code in-process."""

from __future__ import annotations

from celery import shared_task

from capyctl.scheduler import executor, operations, reconcile


@shared_task(acks_late=True, ignore_result=True)
def run_operation(operation_id: int) -> None:
    executor.run_operation(operation_id)


@shared_task(acks_late=True, ignore_result=True)
def ensure_ready(deployment_id: int) -> None:
    try:
        operations.ensure_ready(deployment_id)
    except operations.SchedulerError:
        return  # recorded as an event; the requester sees it through the deployment's state


@shared_task(acks_late=True, ignore_result=True)
def reconcile_host(host_id: int) -> None:
    reconcile.reconcile(host_id)


@shared_task(ignore_result=True)
def reconcile_hosts() -> None:
    """The periodic pass (every few seconds, from Celery beat in server mode)."""
    from capyctl.hosts.models import Host

    for host_id in Host.objects.filter(is_local=True).values_list("pk", flat=True):
        reconcile_host.delay(host_id)
