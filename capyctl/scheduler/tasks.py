"""Celery tasks: thin wrappers around the operations. They take ids, are safe to run twice
(operations use conditional transitions) and are acknowledged late, so a worker that dies
mid-task leaves the task to another. Standalone runs the same code in-process."""

from __future__ import annotations

from celery import shared_task

from capyctl.scheduler import executor, notify, operations, reconcile


@shared_task(acks_late=True, ignore_result=True)
def run_operation(operation_id: int) -> None:
    executor.run_operation(operation_id)


@shared_task(acks_late=True, ignore_result=True)
def ensure_ready(deployment_id: int) -> None:
    """Make a deployment ready for the requests waiting on it, and tell them how it went."""
    try:
        operations.ensure_ready(deployment_id)
    except operations.SchedulerError as exc:
        notify.announce(deployment_id, ok=False, code=exc.code, message=str(exc))
    except Exception as exc:
        notify.announce(
            deployment_id, ok=False, code="unavailable", message=f"{type(exc).__name__}: {exc}"
        )
        raise
    else:
        notify.announce(deployment_id, ok=True)


@shared_task(acks_late=True, ignore_result=True)
def reconcile_host(host_id: int) -> None:
    """One reconcile pass over a host, never two at once for the same host."""
    from django.conf import settings

    from capyctl.hosts.agents import AgentUnreachableError

    lock = None
    if settings.REDIS_URL and not settings.CELERY_TASK_ALWAYS_EAGER:
        import redis

        lock = redis.Redis.from_url(settings.REDIS_URL).lock(
            f"capyctl:reconcile:{host_id}", timeout=120, blocking=False
        )
        if not lock.acquire():
            return  # the pass under way covers it
    try:
        reconcile.reconcile(host_id)
    except AgentUnreachableError:
        return  # the next poll marks the host unreachable
    finally:
        if lock is not None:
            lock.release()


@shared_task(ignore_result=True)
def poll_hosts() -> None:
    """The periodic pass of server mode: ask every host how it is, then reconcile the
    online ones (sent every few seconds by `capyctl start server`)."""
    from django.conf import settings

    from capyctl.hosts.agents import poll_hosts as poll
    from capyctl.hosts.models import Host

    poll()
    hosts = Host.objects.filter(state=Host.State.ONLINE)
    if settings.MODE == "server":  # engines run under agents only; no in-process host
        hosts = hosts.filter(is_local=False)
    for host_id in hosts.values_list("pk", flat=True):
        reconcile_host.delay(host_id)
