"""One re-entrant lock per deployment, in this process: a start, wake, park or stop of one
deployment runs alone here. Across processes the conditional transitions decide (see
:mod:`capyctl.scheduler.transitions`); these locks only spare a process from racing itself.

They also say whether anybody drives a deployment through a passing state: in server mode
a process holding one keeps a lease in Redis while it does (renewed every
:data:`LEASE_RENEW_SECONDS`), so a pass on another worker can tell a wake whose worker
died (no lease anywhere) from one still under way, and repair the first at once rather
than after its timeout. Right after Redis came back (or lost its data) nobody is taken for
gone until the leases had the time to be renewed, and a driver still running on this
machine is never taken for gone (see :class:`_RedisLeases`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from django.conf import settings

from capyctl.scheduler import redislink
from capyctl.scheduler.errors import SchedulerError

logger = logging.getLogger("capyctl.scheduler")
OPERATION_LOCK_SECONDS = 3600.0
_LEASE_KEY = "capyctl:flight:{}"
_DRIVER_KEY = "capyctl:flight-driver:{}"  # the identity of the process that drives it
_LAST_KEY = "capyctl:flight-last"  # when a keeper last renewed
_SINCE_KEY = "capyctl:flight-since"  # when leases began to be renewed again (Redis back)
LEASE_SECONDS = 6
LEASE_RENEW_SECONDS = 2.0
RETRY_SECONDS = 0.5  # while Redis does not answer
DRIVER_SECONDS = 60  # a driver's note outlives an outage that outlives its lease
# Nobody renewed for this long: Redis was away (keepers renew every LEASE_RENEW_SECONDS).
GAP_SECONDS = LEASE_RENEW_SECONDS + 1.5
# After Redis came back, or lost its data: time for every keeper to renew its leases.
SETTLE_SECONDS = LEASE_RENEW_SECONDS + 2.0


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


# The keeper of every process heartbeats each renewal, holding flights or not. KEYS: last,
# since, then lease, driver pairs; ARGV: gap, lease (s), this keeper, identity, driver (s).
_RENEW_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local last = tonumber(redis.call('GET', KEYS[1]))
if not last or now - last > tonumber(ARGV[1]) or redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[2], now)
end
redis.call('SET', KEYS[1], now)
for i = 3, #KEYS, 2 do
  redis.call('SET', KEYS[i], ARGV[3], 'EX', ARGV[2])
  redis.call('SET', KEYS[i + 1], ARGV[4], 'EX', ARGV[5])
end
"""
# 1: somebody holds its lease, or leases cannot be told yet (Redis came back, or lost its
# data, less than SETTLE_SECONDS ago, or nobody renewed lately); the identity of the
# process that last drove it, when it has no lease; 0: nobody. KEYS: lease, driver, last,
# since; ARGV: gap, settle.
_HELD_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local last = tonumber(redis.call('GET', KEYS[3]))
local since = tonumber(redis.call('GET', KEYS[4]))
if not last or not since or now - last > tonumber(ARGV[1]) or now - since < tonumber(ARGV[2]) then
  return 1
end
return redis.call('GET', KEYS[2]) or 0
"""
# Only its own: a lease another process took meanwhile stays. KEYS: lease, driver; ARGV:
# this keeper, identity.
_DROP_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
"""


class _RedisLeases:
    """Leases in Redis, renewed by a thread of this process.

    A lease lost with Redis (a restart without its data, or an outage past the lease) is
    renewed within a retry of Redis answering again; until every keeper has had the time
    to (:data:`SETTLE_SECONDS` after Redis came back, or after nobody renewed for
    :data:`GAP_SECONDS`), nobody is taken for gone. Each lease also leaves a longer-lived
    note of the process that drives it (:data:`DRIVER_SECONDS`): one on this machine that
    still runs is never taken for gone, lease or not.
    """

    def __init__(self, url: str) -> None:
        self._errors = redislink.errors()
        self._link = redislink.link(url)
        self._redis = redislink.client(url)  # asked under the host lock and by passes
        self._background = redislink.client(url, redislink.BACKGROUND_TIMEOUT_SECONDS)
        self._me = uuid.uuid4().hex
        self._renew = self._background.register_script(_RENEW_SCRIPT)
        self._held_script = self._redis.register_script(_HELD_SCRIPT)
        self._drop = self._background.register_script(_DROP_SCRIPT)
        self._held: set[int] = set()
        self._dropped: set[int] = set()  # drops Redis has not heard of yet
        self._lock = threading.Lock()
        self._nudge = threading.Event()
        self._stopped = threading.Event()
        self._failing = False
        threading.Thread(target=self._renewing, name="flight-leases", daemon=True).start()

    def take(self, deployment_id: int) -> None:
        with self._lock:
            self._held.add(deployment_id)
            self._dropped.discard(deployment_id)
        self._nudge.set()  # its keeper sets it at once, off this thread

    def drop(self, deployment_id: int) -> None:
        with self._lock:
            self._held.discard(deployment_id)
            self._dropped.add(deployment_id)
        self._nudge.set()

    def held_elsewhere(self, deployment_id: int) -> bool:
        if not self._link.answers():
            return True  # cannot tell: assume somebody drives it
        keys = [_LEASE_KEY.format(deployment_id), _DRIVER_KEY.format(deployment_id),
                _LAST_KEY, _SINCE_KEY]  # fmt: skip
        try:
            found = self._held_script(keys=keys, args=[GAP_SECONDS, SETTLE_SECONDS])
        except self._errors as exc:
            self._link.failed(exc)
            return True
        if isinstance(found, bytes):  # no lease: its last driver's process still runs?
            return redislink.alive(found) is True
        return bool(found)

    def renew(self) -> None:
        """Heartbeat, renew the leases held here and forget those dropped (raises)."""
        with self._lock:
            held = sorted(self._held)
            dropped = sorted(self._dropped)
        keys = [_LAST_KEY, _SINCE_KEY]
        for deployment_id in held:
            keys += [_LEASE_KEY.format(deployment_id), _DRIVER_KEY.format(deployment_id)]
        args = [GAP_SECONDS, LEASE_SECONDS, self._me, redislink.identity(), DRIVER_SECONDS]
        self._renew(keys=keys, args=args)
        for deployment_id in dropped:
            keys = [_LEASE_KEY.format(deployment_id), _DRIVER_KEY.format(deployment_id)]
            self._drop(keys=keys, args=[self._me, redislink.identity()])
            with self._lock:
                self._dropped.discard(deployment_id)

    def stop(self) -> None:
        self._stopped.set()
        self._nudge.set()

    def _renewing(self) -> None:
        while not self._stopped.is_set():
            try:
                self.renew()
            except self._errors as exc:
                if not self._failing:
                    logger.warning("flight leases not renewed: %s", exc)
                self._failing = True
                self._link.failed(exc)
            else:
                if self._failing:
                    self._link.answered()
                self._failing = False
            self._nudge.wait(RETRY_SECONDS if self._failing else LEASE_RENEW_SECONDS)
            self._nudge.clear()


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
