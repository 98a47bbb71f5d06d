"""Requests in flight per deployment: what a switch waits for before parking a model.

The gateway calls :func:`begin` and :func:`end` around every forwarded request; the
scheduler reads :func:`count`. In standalone the counter lives in this process; in server
mode (``CAPYCTL_REDIS_URL``) it lives in Redis, shared by every process, each process's
requests counted under its own id while its lease lives (a crashed process's vanish within
:data:`LEASE_SECONDS`). The gateway awaits :func:`abegin` and :func:`aend`, which never block
its event loop on Redis.

Draining closes a gate first (:func:`close`): from then on :func:`begin` refuses, in the
same atomic step that counts, so a request that read a slightly old route cannot slip in
after the count reached zero and land on an engine being parked; the gateway sends it to
wait for the wake instead. The gate opens again when the deployment is next ready.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Protocol

from django.conf import settings

logger = logging.getLogger("capyctl.scheduler")

_KEY = "capyctl:inflight:{}"  # a hash: process id -> that process's requests in flight
_CLOSED = "capyctl:inflight-closed:{}"
_LEASE = "capyctl:inflight-lease:"  # + process id: exists while that process runs
_TTL_SECONDS = 3600  # a gate closed by a process that died cannot pin a model forever
# A process's counts count while its lease lives; it renews the lease every third of this,
# so the counts of a process that died vanish within this many seconds.
LEASE_SECONDS = 10
_BEGIN_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
_END_SCRIPT = """
local left = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return left
"""
# The live processes' counts; a dead process's (its lease expired) are dropped.
_COUNT_SCRIPT = """
local total = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if redis.call('EXISTS', ARGV[1] .. fields[i]) == 1 then
    total = total + tonumber(fields[i + 1])
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
return total
"""


class InFlight(Protocol):
    def begin(self, deployment_id: int) -> bool: ...

    def close(self, deployment_id: int) -> None: ...

    def reopen(self, deployment_id: int) -> None: ...

    def end(self, deployment_id: int) -> None: ...

    def count(self, deployment_id: int) -> int: ...

    async def abegin(self, deployment_id: int) -> bool: ...

    async def aend(self, deployment_id: int) -> None: ...


class LocalInFlight:
    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._closed: set[int] = set()
        self._lock = threading.Lock()

    def begin(self, deployment_id: int) -> bool:
        with self._lock:
            if deployment_id in self._closed:
                return False
            self._counts[deployment_id] = self._counts.get(deployment_id, 0) + 1
            return True

    def close(self, deployment_id: int) -> None:
        with self._lock:
            self._closed.add(deployment_id)

    def reopen(self, deployment_id: int) -> None:
        with self._lock:
            self._closed.discard(deployment_id)

    def end(self, deployment_id: int) -> None:
        with self._lock:
            left = self._counts.get(deployment_id, 0) - 1
            if left > 0:
                self._counts[deployment_id] = left
            else:
                self._counts.pop(deployment_id, None)

    def count(self, deployment_id: int) -> int:
        with self._lock:
            return self._counts.get(deployment_id, 0)

    async def abegin(self, deployment_id: int) -> bool:
        return self.begin(deployment_id)

    async def aend(self, deployment_id: int) -> None:
        self.end(deployment_id)


class RedisInFlight:
    """Counts shared by every process, each process's under its own id in a hash, and
    counted only while that process's lease lives: an API process that crashed stops
    holding drains within :data:`LEASE_SECONDS`, not the hour its keys last."""

    def __init__(self, url: str) -> None:
        import redis
        import redis.asyncio

        self.process = uuid.uuid4().hex
        self._redis = redis.Redis.from_url(url, socket_timeout=2)
        self._async = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        self._end = self._redis.register_script(_END_SCRIPT)
        self._begin = self._redis.register_script(_BEGIN_SCRIPT)
        self._count = self._redis.register_script(_COUNT_SCRIPT)
        self._async_begin = self._async.register_script(_BEGIN_SCRIPT)
        self._async_end = self._async.register_script(_END_SCRIPT)
        self._renew()
        self._renewer = threading.Thread(target=self._renewing, name="inflight-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        self._redis.set(_LEASE + self.process, 1, ex=LEASE_SECONDS)

    def _renewing(self) -> None:
        while True:
            time.sleep(LEASE_SECONDS / 3)
            try:
                self._renew()
            except Exception as exc:  # Redis away for a moment: the next renewal retries
                logger.warning("could not renew the in-flight lease: %s", exc)

    def _keys(self, deployment_id: int) -> list[str]:
        return [_KEY.format(deployment_id), _CLOSED.format(deployment_id)]

    def begin(self, deployment_id: int) -> bool:
        args: list[str | int] = [self.process, _TTL_SECONDS]
        return bool(self._begin(keys=self._keys(deployment_id), args=args))

    async def abegin(self, deployment_id: int) -> bool:
        args: list[str | int] = [self.process, _TTL_SECONDS]
        return bool(await self._async_begin(keys=self._keys(deployment_id), args=args))

    def close(self, deployment_id: int) -> None:
        self._redis.set(_CLOSED.format(deployment_id), 1, ex=_TTL_SECONDS)

    def reopen(self, deployment_id: int) -> None:
        self._redis.delete(_CLOSED.format(deployment_id))

    def end(self, deployment_id: int) -> None:
        # Decrement and drop an emptied field in one step, so a request that begins in
        # between is never wiped out.
        self._end(keys=[_KEY.format(deployment_id)], args=[self.process])

    async def aend(self, deployment_id: int) -> None:
        await self._async_end(keys=[_KEY.format(deployment_id)], args=[self.process])

    def count(self, deployment_id: int) -> int:
        return max(int(self._count(keys=[_KEY.format(deployment_id)], args=[_LEASE])), 0)


_tracker: InFlight | None = None
_tracker_lock = threading.Lock()


def tracker() -> InFlight:
    global _tracker  # noqa: PLW0603 - one tracker per process
    with _tracker_lock:
        if _tracker is None:
            _tracker = RedisInFlight(settings.REDIS_URL) if settings.REDIS_URL else LocalInFlight()
        return _tracker


def begin(deployment_id: int) -> bool:
    """Count a request in; False (and not counted) while the deployment drains."""
    return tracker().begin(deployment_id)


async def abegin(deployment_id: int) -> bool:
    """:func:`begin` for the event loop: in server mode it awaits Redis, never blocks."""
    return await tracker().abegin(deployment_id)


async def aend(deployment_id: int) -> None:
    await tracker().aend(deployment_id)


def close(deployment_id: int) -> None:
    tracker().close(deployment_id)


def reopen(deployment_id: int) -> None:
    tracker().reopen(deployment_id)


def end(deployment_id: int) -> None:
    tracker().end(deployment_id)


def count(deployment_id: int) -> int:
    return tracker().count(deployment_id)


def wait_drained(deployment_id: int, timeout: float) -> bool:
    """Wait until no request for the deployment is in flight; False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while count(deployment_id) > 0:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
