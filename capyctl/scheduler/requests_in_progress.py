"""Requests in flight per deployment: what a switch waits for before parking a model.

The gateway calls :func:`begin` and :func:`end` around every forwarded request; the
scheduler reads :func:`count`. In standalone the counter lives in this process
(:class:`LocalInFlight`); in server mode (``CAPYCTL_REDIS_URL``) it is shared through Redis
by every process (:class:`~capyctl.scheduler.requests_in_progress_redis.RedisInFlight`,
whose module says when its counts can be trusted: else :class:`CountsUnknown`). The gateway
awaits :func:`abegin` and :func:`aend`, which never block its event loop on Redis.

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

from capyctl.scheduler.requests_in_progress_redis import CountsUnknown, RedisInFlight

# The counters, and what a count that cannot be trusted raises, importable from here.
__all__ = [
    "CountsUnknown",
    "InFlight",
    "LocalInFlight",
    "RedisInFlight",
    "abegin",
    "aend",
    "begin",
    "close",
    "count",
    "count_or_none",
    "down_since",
    "end",
    "idle_seconds",
    "reopen",
    "serves_here",
    "tracker",
    "wait_drained",
]


class InFlight(Protocol):
    down_since: float | None

    def begin(self, deployment_id: int) -> bool: ...

    def close(self, deployment_id: int) -> None: ...

    def reopen(self, deployment_id: int) -> None: ...

    def end(self, deployment_id: int) -> None: ...

    def count(self, deployment_id: int) -> int: ...

    def idle_seconds(self, deployment_id: int) -> float | None: ...

    async def abegin(self, deployment_id: int) -> bool: ...

    async def aend(self, deployment_id: int) -> None: ...


class LocalInFlight:
    down_since: float | None = None  # never: nothing outside this process is counted on

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._closed: set[int] = set()
        self._ended: dict[int, float] = {}  # when its last request ended (monotonic)
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
            self._ended[deployment_id] = time.monotonic()
            left = self._counts.get(deployment_id, 0) - 1
            if left > 0:
                self._counts[deployment_id] = left
            else:
                self._counts.pop(deployment_id, None)

    def count(self, deployment_id: int) -> int:
        with self._lock:
            return self._counts.get(deployment_id, 0)

    def idle_seconds(self, deployment_id: int) -> float | None:
        """Seconds since its last request ended here; None when none has."""
        with self._lock:
            ended = self._ended.get(deployment_id)
        return None if ended is None else time.monotonic() - ended

    async def abegin(self, deployment_id: int) -> bool:
        return self.begin(deployment_id)

    async def aend(self, deployment_id: int) -> None:
        self.end(deployment_id)


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


def idle_seconds(deployment_id: int) -> float | None:
    """Seconds since a request for it last ended, where this process saw it (standalone
    sees every one); None when it cannot tell (then ``last_request_at`` says, to a second
    or so)."""
    return tracker().idle_seconds(deployment_id)


def down_since() -> float | None:
    """When this process last found Redis not answering (wall clock), or None."""
    return tracker().down_since


_serving = False  # whether this process serves /v1 (standalone's counts live there)


def serving() -> None:
    """This process serves ``/v1``: its counts are the installation's (standalone)."""
    global _serving  # noqa: PLW0603 - one flag a process, set once by the gateway
    _serving = True


def serves_here() -> bool:
    """Whether this process serves ``/v1`` (:func:`serving` was called)."""
    return _serving


def count_if_known(deployment_id: int) -> int | None:
    """:func:`count_or_none` where this process can know it (server mode's shared counts,
    or standalone's serving process); None in another process (a command line)."""
    if not settings.REDIS_URL and not _serving:
        return None
    return count_or_none(deployment_id)


def count_or_none(deployment_id: int) -> int | None:
    """:func:`count`, or None while the counts are unknown (for a display, a hint)."""
    try:
        return count(deployment_id)
    except CountsUnknown:
        return None


# A drain gives up after the shared counts stayed unknown this long (well past a Redis
# restart's rebuilding, a few seconds).
UNKNOWN_PATIENCE_SECONDS = 15.0


def wait_drained(deployment_id: int, timeout: float) -> bool:
    """Wait until no request for the deployment is in flight; False after ``timeout``.
    Raises CountsUnknown when the counts stayed unknown for
    :data:`UNKNOWN_PATIENCE_SECONDS` (or until the timeout): an unknown count is never
    taken for zero."""
    started = time.monotonic()
    deadline = started + timeout
    unknown_since: float | None = None
    while True:
        try:
            if unknown_since is not None:
                close(deployment_id)  # a Redis restart forgets the gate: close it again
            if count(deployment_id) == 0:
                return True
            unknown_since = None
        except CountsUnknown:
            now = time.monotonic()
            unknown_since = now if unknown_since is None else unknown_since
            if now - unknown_since >= UNKNOWN_PATIENCE_SECONDS or now >= deadline:
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
