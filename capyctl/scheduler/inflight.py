"""Requests in flight per deployment: what a switch waits for before parking a model.

The gateway calls :func:`begin` and :func:`end` around every forwarded request; the
scheduler reads :func:`count`. In standalone the counter lives in this process; in server
mode (``CAPYCTL_REDIS_URL``) it lives in Redis, shared by every process.

Draining closes a gate first (:func:`close`): from then on :func:`begin` refuses, in the
same atomic step that counts, so a request that read a slightly old route cannot slip in
after the count reached zero and land on an engine being parked; the gateway sends it to
wait for the wake instead. The gate opens again when the deployment is next ready.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from django.conf import settings

_KEY = "capyctl:inflight:{}"
_CLOSED = "capyctl:inflight-closed:{}"
_TTL_SECONDS = 3600  # a crashed process's counts (or gate) cannot pin a model forever
_BEGIN_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
_END_SCRIPT = """
local left = redis.call('DECR', KEYS[1])
if left <= 0 then redis.call('DEL', KEYS[1]) end
return left
"""


class InFlight(Protocol):
    def begin(self, deployment_id: int) -> bool: ...

    def close(self, deployment_id: int) -> None: ...

    def reopen(self, deployment_id: int) -> None: ...

    def end(self, deployment_id: int) -> None: ...

    def count(self, deployment_id: int) -> int: ...


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


class RedisInFlight:
    def __init__(self, url: str) -> None:
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=2)
        self._end = self._redis.register_script(_END_SCRIPT)
        self._begin = self._redis.register_script(_BEGIN_SCRIPT)

    def begin(self, deployment_id: int) -> bool:
        keys = [_KEY.format(deployment_id), _CLOSED.format(deployment_id)]
        return bool(self._begin(keys=keys, args=[_TTL_SECONDS]))

    def close(self, deployment_id: int) -> None:
        self._redis.set(_CLOSED.format(deployment_id), 1, ex=_TTL_SECONDS)

    def reopen(self, deployment_id: int) -> None:
        self._redis.delete(_CLOSED.format(deployment_id))

    def end(self, deployment_id: int) -> None:
        # Decrement and drop an emptied key in one step, so a request that begins in
        # between is never wiped out.
        self._end(keys=[_KEY.format(deployment_id)])

    def count(self, deployment_id: int) -> int:
        value = self._redis.get(_KEY.format(deployment_id))
        return max(int(value), 0) if value is not None else 0


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
