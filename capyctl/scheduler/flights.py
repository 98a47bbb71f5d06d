"""One re-entrant lock per deployment, in this process: a start, wake, park or stop of one
deployment runs alone here. Across processes the conditional transitions decide (see
:mod:`capyctl.scheduler.transitions`); these locks only spare a process from racing itself.

They also say whether anybody drives a deployment through a passing state: in server mode
a process holding one keeps a lease in Redis while it does (renewed every
:data:`LEASE_RENEW_SECONDS`), so a pass on another worker can tell a wake whose worker
died (no lease anywhere) from one still under way, and repair the first at once rather
than after its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from django.conf import settings

from capyctl.scheduler.errors import SchedulerError

logger = logging.getLogger("capyctl.scheduler")
OPERATION_LOCK_SECONDS = 3600.0
_LEASE_KEY = "capyctl:flight:{}"
LEASE_SECONDS = 6
LEASE_RENEW_SECONDS = 2.0


class Flight:
    """The lock of one deployment in this process (re-entrant), with its lease."""

    def __init__(self, deployment_id: int) -> None:
        self.deployment_id = deployment_id
        self._lock = threading.RLock()
        self._depth = 0  # changed only by the thread holding the lock

    def acquire(self, timeout: float = -1) -> bool:
        if not self._lock.acquire(timeout=timeout):
            return False
        self._depth += 1
        if self._depth == 1:
            _leases().take(self.deployment_id)
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            _leases().drop(self.deployment_id)
        self._lock.release()

    def free_here(self) -> bool:
        """Whether no thread of this process holds it (a look: no lease taken)."""
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return True
        return False


class _NoLeases:
    """Standalone: every operation runs in this process, whose locks say it all."""

    def take(self, deployment_id: int) -> None:
        return None

    def drop(self, deployment_id: int) -> None:
        return None

    def held_elsewhere(self, deployment_id: int) -> bool:
        return False


class _RedisLeases:
    def __init__(self, url: str) -> None:
        import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._me = uuid.uuid4().hex
        # Only its own: a lease another process took meanwhile stays.
        self._drop = self._redis.register_script(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end"
        )
        self._held: set[int] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._renewing, name="flight-leases", daemon=True).start()

    def _set(self, deployment_id: int) -> None:
        try:
            self._redis.set(_LEASE_KEY.format(deployment_id), self._me, ex=LEASE_SECONDS)
        except self._errors as exc:  # no lease: a pass may repair it sooner; said once here
            logger.warning("no lease on deployment %s's operation: %s", deployment_id, exc)

    def take(self, deployment_id: int) -> None:
        with self._lock:
            self._held.add(deployment_id)
        self._set(deployment_id)

    def drop(self, deployment_id: int) -> None:
        with self._lock:
            self._held.discard(deployment_id)
        with contextlib.suppress(*self._errors):  # it lapses by itself
            self._drop(keys=[_LEASE_KEY.format(deployment_id)], args=[self._me])

    def held_elsewhere(self, deployment_id: int) -> bool:
        try:
            return bool(self._redis.exists(_LEASE_KEY.format(deployment_id)))
        except self._errors:
            return True  # cannot tell: assume somebody drives it

    def _renewing(self) -> None:
        stop = threading.Event()
        while not stop.wait(LEASE_RENEW_SECONDS):
            with self._lock:
                held = list(self._held)
            for deployment_id in held:
                self._set(deployment_id)


_flights: dict[int, Flight] = {}
_flights_lock = threading.Lock()
_lease_keeper: Any = None


def _leases() -> _NoLeases | _RedisLeases:
    global _lease_keeper  # noqa: PLW0603 - one a process, made on first use
    with _flights_lock:
        if _lease_keeper is None:
            eager = settings.CELERY_TASK_ALWAYS_EAGER
            url = settings.REDIS_URL
            _lease_keeper = _RedisLeases(url) if url and not eager else _NoLeases()
        return _lease_keeper  # type: ignore[no-any-return]


def flight(deployment_id: int) -> Flight:
    with _flights_lock:
        return _flights.setdefault(deployment_id, Flight(deployment_id))


@contextlib.contextmanager
def operating(deployment_id: int, name: str) -> Iterator[None]:
    """Hold the deployment's lock for the block (re-entrant)."""
    lock = flight(deployment_id)
    if not lock.acquire(timeout=OPERATION_LOCK_SECONDS):
        raise SchedulerError(f"{name}: another operation on it did not finish")
    try:
        yield
    finally:
        lock.release()


def flight_free(deployment_id: int) -> bool:
    """Whether no operation on the deployment is under way in this process."""
    return flight(deployment_id).free_here()


def driven_anywhere(deployment_id: int) -> bool:
    """Whether some process (this one, or in server mode any other) drives an operation
    on the deployment now."""
    return not flight_free(deployment_id) or _leases().held_elsewhere(deployment_id)
