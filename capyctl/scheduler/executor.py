"""The scheduler loop of the process that owns the engines (standalone's server).

It carries out requested operations (saved as Operation rows by the CLI, REST and admin),
reconciles the local host every few seconds, and says it is alive by refreshing the
host's ``last_seen_at``. Operations run on worker threads, never on the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.utils import timezone

from capyctl.hosts.models import LOCAL_HOST_NAME, Host
from capyctl.hosts.services import local_host_beat
from capyctl.scheduler import host_drains, replica_scaling, wakes
from capyctl.scheduler.errors import ControlPlaneUnavailableError, is_control_plane_error
from capyctl.scheduler.models import Operation
from capyctl.scheduler.operation_runs import run_operation
from capyctl.scheduler.reconcile import reconcile
from capyctl.scheduler.remote_hosts import AgentUnreachableError, poll_hosts

logger = logging.getLogger("capyctl.scheduler")

ALIVE_WITHIN = timedelta(seconds=15)


# How often standalone's loop reconciles its hosts (idle parks, engines gone, parks to confirm).
RECONCILE_SECONDS = 2.0


class SchedulerLoop(threading.Thread):
    """Runs in standalone's server process beside the ASGI server."""

    def __init__(
        self, *, interval: float = 0.2, reconcile_every: float = RECONCILE_SECONDS
    ) -> None:
        super().__init__(name="capyctl-scheduler", daemon=True)
        self.interval = interval
        self.reconcile_every = reconcile_every
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="capyctl-op")
        self._reconciling = threading.Lock()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self) -> None:
        last_reconcile = 0.0
        while not self._stopping.is_set():
            try:
                close_old_connections()
                for operation_id in pending_operations():
                    self._pool.submit(run_operation, operation_id)
                if time.monotonic() - last_reconcile >= self.reconcile_every:
                    last_reconcile = time.monotonic()
                    local_host_beat()
                    if self._reconciling.acquire(blocking=False):
                        self._pool.submit(self._reconcile)
            except Exception:  # the loop must outlive any one failure
                logger.exception("scheduler loop pass failed")
            finally:
                connection.close()
            self._stopping.wait(self.interval)

    def _reconcile(self) -> None:
        try:
            host = Host.objects.filter(name=LOCAL_HOST_NAME).first()
            if host is not None:
                reconcile(host.pk)
            poll_hosts()
            replica_scaling.scale_all(wakes.ready_later)
            host_drains.drain_all(wakes.later(host_drains.move))
            for remote in Host.objects.filter(is_local=False, state=Host.State.ONLINE):
                try:
                    reconcile(remote.pk)
                except AgentUnreachableError as exc:  # the next poll marks it unreachable
                    logger.info("reconcile of %s skipped: %s", remote.name, exc)
        except Exception:
            logger.exception("reconcile failed")
        finally:
            self._reconciling.release()
            connection.close()


def pending_operations(*, older_than: timedelta | None = None) -> list[int]:
    """The ids of up to 32 operations nobody has taken up yet; with ``older_than``, only
    those saved at least that long ago (server mode's beat sends them again: their
    message to a worker may have been lost)."""
    pending = Operation.objects.filter(status=Operation.Status.PENDING)
    if older_than is not None:
        pending = pending.filter(created_at__lt=timezone.now() - older_than)
    return list(pending.values_list("pk", flat=True)[:32])


SERVER_ALIVE_KEY = "capyctl:server-alive"  # refreshed by `capyctl start server` in Redis


def server_alive() -> bool:
    """Whether a server is running on this database: standalone's loop beat recently, or
    (server mode) the supervisor's beat is in Redis. Raises ControlPlaneUnavailableError
    when Redis does not answer: then nobody can say, nor be handed anything."""
    if settings.MODE == "server":
        import redis  # noqa: PLC0415 - server mode only: standalone never loads redis

        client = redis.Redis.from_url(
            settings.REDIS_URL or "", socket_timeout=2, socket_connect_timeout=2
        )
        try:
            return bool(client.exists(SERVER_ALIVE_KEY))
        except (redis.RedisError, OSError) as exc:
            raise ControlPlaneUnavailableError(
                "Redis does not answer, so nothing can be handed to the workers now; "
                "retry when it is back"
            ) from exc
        finally:
            client.close()
    host = Host.objects.filter(name=LOCAL_HOST_NAME).first()
    return bool(host and host.heartbeat_at and timezone.now() - host.heartbeat_at < ALIVE_WITHIN)


def submit(operation: Operation) -> None:
    """Hand a saved operation to whoever carries it out: in server mode a Celery worker
    (once the row is committed); standalone's loop finds it by itself."""
    if settings.MODE == "server":
        from capyctl.scheduler import tasks  # noqa: PLC0415 - server mode only: standalone never loads Celery

        def hand_over() -> None:
            try:
                tasks.run_operation.delay(operation.pk)
            except Exception as exc:  # saved: the next pass sends what was not handed over
                if not is_control_plane_error(exc):
                    raise
                logger.warning("%s of %s waits for the next pass: %s", operation.action,
                               operation.deployment.name, exc)  # fmt: skip

        transaction.on_commit(hand_over)
