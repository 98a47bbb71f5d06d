"""Celery tasks: thin wrappers around the operations. They take ids, are safe to run twice
(operations use conditional transitions) and are acknowledged late, so a worker that dies
mid-task leaves the task to another. Standalone runs the same code in-process."""

from __future__ import annotations

import contextlib
import logging
import threading

from celery import shared_task
from django.conf import settings

# CapyCTL's Celery app (imported first) is made current before any task is sent, so tasks
# run eagerly in standalone and go to the configured broker in server mode, never to a
# library default. It is imported here, not at start-up: commands that send no task never
# load Celery.
from capyctl import celery as _celery  # noqa: F401
from capyctl.hosts.models import Host
from capyctl.scheduler import (
    actions,
    errors,
    host_drains,
    notify,
    operation_runs,
    reconcile,
    remote_hosts,
    replica_scaling,
    switches,
)
from capyctl.scheduler.errors import ControlPlaneUnavailableError, is_control_plane_error, outage
from capyctl.scheduler.remote_hosts import AgentUnreachableError

logger = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def run_operation(operation_id: int) -> None:
    operation_runs.run_operation(operation_id)


@shared_task(acks_late=True, ignore_result=True)
def ensure_ready(deployment_id: int) -> None:
    """Make a deployment ready for the requests waiting on it, and tell them how it went."""
    try:
        with switches.collecting() as steps:
            actions.ensure_ready(deployment_id)
    except errors.SchedulerError as exc:
        notify.announce(deployment_id, ok=False, code=exc.code, message=str(exc))
    except Exception as exc:
        if is_control_plane_error(exc):  # the waiters learn that much, not the address
            notify.announce(
                deployment_id,
                ok=False,
                code=ControlPlaneUnavailableError.code,
                message=outage(exc).message,
            )
        else:
            notify.announce(deployment_id, ok=False, code="unavailable",
                            message=f"{type(exc).__name__}: {exc}")  # fmt: skip
        raise
    else:
        notify.announce(deployment_id, ok=True, switch=switches.header(steps))


# A reconcile pass holds a short lease that a thread renews while the pass runs: a pass
# can take minutes (an idle park drains first), yet a worker killed mid-pass must not keep
# its host from being reconciled for longer than one lease.
LEASE_SECONDS = 10
_RENEW_SECONDS = 3


@shared_task(acks_late=True, ignore_result=True)
def reconcile_host(host_id: int) -> None:
    """One reconcile pass over a host, never two at once for the same host."""
    if not settings.REDIS_URL or settings.CELERY_TASK_ALWAYS_EAGER:
        with contextlib.suppress(AgentUnreachableError):  # the next poll marks it unreachable
            reconcile.reconcile(host_id)
        return
    import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

    lock = redis.Redis.from_url(settings.REDIS_URL).lock(
        f"capyctl:reconcile:{host_id}",
        timeout=LEASE_SECONDS,
        blocking=False,
        thread_local=False,  # the renewing thread uses the same token
    )
    if not lock.acquire():
        return  # the pass under way covers it
    done = threading.Event()

    def renew() -> None:
        while not done.wait(_RENEW_SECONDS):
            try:
                lock.reacquire()
            except Exception:  # lost (Redis restarted): the pass finishes; next one re-takes
                logger.warning("reconcile lease of host %s lapsed mid-pass", host_id)
                return

    renewer = threading.Thread(target=renew, name=f"lease-{host_id}", daemon=True)
    renewer.start()
    try:
        reconcile.reconcile(host_id)
    except AgentUnreachableError:
        return  # the next poll marks the host unreachable
    finally:
        done.set()
        renewer.join()
        with contextlib.suppress(redis.exceptions.LockError):  # lapsed; another may hold it
            lock.release()


@shared_task(ignore_result=True)
def poll_hosts() -> None:
    """The periodic pass of server mode: ask every host how it is, then reconcile the
    online ones (sent every few seconds by `capyctl start server`)."""
    remote_hosts.poll_hosts()
    hosts = Host.objects.filter(state=Host.State.ONLINE)
    if settings.MODE == "server":  # engines run under agents only; no in-process host
        hosts = hosts.filter(is_local=False)
    for host_id in hosts.values_list("pk", flat=True):
        reconcile_host.delay(host_id)
    scale_replicas.delay()


@shared_task(acks_late=True, ignore_result=True)
def move_off_draining_host(deployment_id: int) -> None:
    """Move one model off its draining host (:func:`capyctl.scheduler.host_drains.move`)."""
    try:
        host_drains.move(deployment_id)
    except errors.SchedulerError as exc:
        logger.info("moving deployment %s off its draining host: %s", deployment_id, exc)


@shared_task(ignore_result=True)
def scale_replicas() -> None:
    """The replicas' pass (:mod:`capyctl.scheduler.replica_scaling`) and the draining
    hosts' (:mod:`capyctl.scheduler.host_drains`), never two at once."""
    if not settings.REDIS_URL or settings.CELERY_TASK_ALWAYS_EAGER:
        replica_scaling.scale_all(ensure_ready)
        host_drains.drain_all(move_off_draining_host)
        return
    import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

    lock = redis.Redis.from_url(settings.REDIS_URL).lock(
        "capyctl:scale-replicas", timeout=LEASE_SECONDS, blocking=False
    )
    if not lock.acquire():
        return  # the pass under way covers it
    try:
        replica_scaling.scale_all(ensure_ready.delay)
        host_drains.drain_all(move_off_draining_host.delay)
    finally:
        with contextlib.suppress(redis.exceptions.LockError):
            lock.release()
