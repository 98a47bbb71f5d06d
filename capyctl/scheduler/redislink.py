"""The scheduler's short Redis calls, and who a process is.

Calls made on the request path (counting a request in and out) and under the host lock
(reading counts, turns, leases) must never hold either for long: a Redis that hangs (a
pause, a partition: timeouts, not refused connections) would hold every request, and every
change on the host, for the whole socket timeout. So they use clients with short timeouts
(:func:`client`, :func:`async_client`), and once one of them did not answer, this process
asks Redis nothing on those paths for :data:`QUIET_SECONDS` (:meth:`Link.answers`): they do what
they do when Redis is away at once. Background loops (the in-flight check-ins, the flight
leases) keep trying, and the first of them that gets an answer ends the quiet period
(:meth:`Link.answered`). Each Redis server has its own (:func:`link`).

:func:`identity` names this process so that another process on the same machine can tell
whether it still runs (:func:`alive`): a sign that does not depend on Redis.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

logger = logging.getLogger("capyctl.scheduler")

TIMEOUT_SECONDS = 0.25  # a call on the request path or under the host lock
BACKGROUND_TIMEOUT_SECONDS = 1.0  # a background loop's call
QUIET_SECONDS = 5.0  # after a call did not answer, how long those paths ask Redis nothing


class Link:
    """The quiet period of one Redis server, shared by every caller in this process."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._quiet_until = 0.0
        self._lock = threading.Lock()

    def answers(self) -> bool:
        """Whether calls on the request path and under the host lock may ask it now."""
        return time.monotonic() >= self._quiet_until

    def failed(self, exc: BaseException) -> None:
        """A call did not answer: the short paths ask it nothing for a while."""
        with self._lock:
            if time.monotonic() >= self._quiet_until:
                logger.debug("Redis at %s did not answer (%s): quiet for %ss", self.address,
                             exc, QUIET_SECONDS)  # fmt: skip
            self._quiet_until = time.monotonic() + QUIET_SECONDS

    def answered(self) -> None:
        """A background call got its answer: it is back for every path."""
        with self._lock:
            self._quiet_until = 0.0


_links: dict[str, Link] = {}
_links_lock = threading.Lock()


def link(url: str) -> Link:
    """The quiet period of the Redis server at ``url`` (its databases share it)."""
    parsed = urlsplit(url)
    address = parsed.path if parsed.scheme == "unix" else f"{parsed.hostname}:{parsed.port or 6379}"
    with _links_lock:
        return _links.setdefault(address, Link(address))


def client(url: str, timeout: float = TIMEOUT_SECONDS) -> Any:
    import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def async_client(url: str) -> Any:
    import redis.asyncio  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

    return redis.asyncio.Redis.from_url(
        url, socket_timeout=TIMEOUT_SECONDS, socket_connect_timeout=TIMEOUT_SECONDS
    )


def errors() -> tuple[type[BaseException], ...]:
    import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

    return (redis.RedisError, OSError)


def _machine() -> str:
    """This boot of this machine and this pid namespace: where pids mean the same."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        return ""  # nowhere to compare pids: nobody can vouch for this process
    return f"{boot}/{namespace}"


def _started(pid: int) -> float:
    return round(psutil.Process(pid).create_time(), 2)


_identity: str | None = None


def identity() -> str:
    """``host|machine|pid|started``: this process, as :func:`alive` reads it."""
    global _identity  # noqa: PLW0603 - computed once a process
    if _identity is None or _identity.split("|")[2] != str(os.getpid()):  # forked since
        _identity = f"{socket.gethostname()}|{_machine()}|{os.getpid()}|{_started(os.getpid())}"
    return _identity


def alive(who: str | bytes | None) -> bool | None:
    """Whether the process :func:`identity` named runs: True or False when it ran on this
    machine in this pid namespace, None when this process cannot tell."""
    if isinstance(who, bytes):
        who = who.decode(errors="replace")
    parts = (who or "").split("|")
    if len(parts) != 4 or not parts[1] or parts[1] != _machine():
        return None
    try:
        pid, started = int(parts[2]), float(parts[3])
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(_started(pid) - started) < 0.05  # else its pid was given to another
    except (ValueError, psutil.NoSuchProcess):
        return False
    except psutil.Error:
        return None


def describe(who: str | bytes | None) -> str:
    """``host pid N`` for a message."""
    if isinstance(who, bytes):
        who = who.decode(errors="replace")
    parts = (who or "").split("|")
    return f"{parts[0]} pid {parts[2]}" if len(parts) == 4 else "a process"
