"""Requests in flight per deployment: what a switch waits for before parking a model.

The gateway calls :func:`begin` and :func:`end` around every forwarded request; the
scheduler reads :func:`count`. In standalone the counter lives in this process; in server
mode (``CAPYCTL_REDIS_URL``) it is shared through Redis by every process. The gateway
awaits :func:`abegin` and :func:`aend`, which never block its event loop on Redis.

Draining closes a gate first (:func:`close`): from then on :func:`begin` refuses, in the
same atomic step that counts, so a request that read a slightly old route cannot slip in
after the count reached zero and land on an engine being parked; the gateway sends it to
wait for the wake instead. The gate opens again when the deployment is next ready.

In Redis, each process publishes its own count of a deployment's requests as one field of
the deployment's hash, ``count:seq``: the count it knows exactly, numbered, so a late write
never replaces a newer one. Its counts count while its lease lives (a crashed process's
vanish within :data:`LEASE_SECONDS`). When Redis does not answer, a process goes on
counting its own requests (ready models keep answering) and publishes its counts again
once Redis is back; meanwhile :func:`count` raises :class:`CountsUnknown`, and so it does
until every live process has checked in since (a Redis restart forgets every count: each
process publishes its own again within a second or so; a new Redis looks the same, so its
first seconds are unknown too): no drain trusts a count that may miss a request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Protocol

from django.conf import settings
from django.db import connection

from capyctl.scheduler.errors import ControlPlaneUnavailableError

logger = logging.getLogger("capyctl.scheduler")

_KEY = "capyctl:inflight:{}"  # a hash: process id -> "count:seq" of that process
_CLOSED = "capyctl:inflight-closed:{}"
_LEASE = "capyctl:inflight-lease:"  # + process id: exists while that process runs
_PROCESSES = "capyctl:inflight-processes"  # sorted set: process id -> when it last checked in
_EPOCH = "capyctl:inflight-epoch"  # made with the first lease; gone: Redis lost every count
_REBUILDING = "capyctl:inflight-rebuilding"  # counts being published again after a loss
_TTL_SECONDS = 3600  # a gate closed by a process that died cannot pin a model forever
# A process's counts count while its lease lives, so the counts of a process that died
# vanish within this many seconds. It checks in (renews the lease, publishes its counts)
# every CHECK_IN_SECONDS, or every half second while Redis does not answer.
LEASE_SECONDS = 5
CHECK_IN_SECONDS = 1.0
# A live process that has not checked in for CHECK_IN_SECONDS and this much more may hold
# counts Redis lacks; after Redis lost its data, counts are untrusted for as long.
_CHECK_IN_SLACK_SECONDS = 2.0

# KEYS: the hash, the gate; ARGV: process, count, seq, check the gate (1/0), ttl.
_WRITE_SCRIPT = """
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local seq = tonumber(string.match(old, ':(%d+)$'))
  if seq and seq >= tonumber(ARGV[3]) then return 1 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""
# The live processes' counts, or -1 when they cannot be trusted: Redis lost its data and
# not every process has published again, or a live process has not checked in lately.
# KEYS: the hash, epoch, rebuilding, processes; ARGV: lease prefix, stale after (seconds).
_COUNT_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('EXISTS', KEYS[3]) == 1 then
  return -1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local stale = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]))
for _, process in ipairs(stale) do
  if redis.call('EXISTS', ARGV[1] .. process) == 1 then return -1 end
  redis.call('ZREM', KEYS[4], process)
end
local total = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if redis.call('EXISTS', ARGV[1] .. fields[i]) == 1 then
    total = total + math.max(tonumber(string.match(fields[i + 1], '^(%-?%d+)')) or 0, 0)
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
return total
"""
# A process checks in: its lease renewed, its counts published again (a write older than
# what is there changes nothing). Counts are untrusted for a while, time enough for every
# live process to check in, when the epoch is missing (a Redis that lost its data looks
# like a new one: whoever checks in first, even a process started since, cannot tell, and
# others may have requests in flight), and when a process that had a lease finds it gone
# (Redis lost the counts, or it was cut off past its lease). KEYS: lease, processes,
# epoch, rebuilding, then the hashes; ARGV: process, lease (ms), had a lease (1/0),
# rebuilding (ms), then count, seq pairs.
_CHECK_IN_SCRIPT = """
local had = redis.call('EXISTS', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('SET', KEYS[1], 1, 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SET', KEYS[3], now)
  redis.call('SET', KEYS[4], 1, 'PX', ARGV[4])
elseif had == 0 and ARGV[3] == '1' then
  redis.call('SET', KEYS[4], 1, 'PX', ARGV[4])
end
for i = 5, #KEYS do
  local count = ARGV[(i - 5) * 2 + 5]
  local seq = tonumber(ARGV[(i - 5) * 2 + 6])
  local old = redis.call('HGET', KEYS[i], ARGV[1])
  local known = old and tonumber(string.match(old, ':(%d+)$'))
  if not known or known < seq then
    redis.call('HSET', KEYS[i], ARGV[1], count .. ':' .. seq)
    redis.call('EXPIRE', KEYS[i], 3600)
  end
end
return had
"""


class CountsUnknown(ControlPlaneUnavailableError):  # noqa: N818 - reads as what it says
    """The shared counts cannot be read or trusted now (Redis does not answer, or has just
    come back): a drain must not take them for zero."""


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


class RedisInFlight:
    """Counts shared by every process through Redis; see the module's docstring.

    Every count is this process's own, kept here first and published after; a Redis that
    does not answer costs no request, only the trust in the shared counts.
    """

    def __init__(self, url: str) -> None:
        import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it
        import redis.asyncio  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

        self.process = uuid.uuid4().hex
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._async = redis.asyncio.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._write = self._redis.register_script(_WRITE_SCRIPT)
        self._count = self._redis.register_script(_COUNT_SCRIPT)
        self._check_in = self._redis.register_script(_CHECK_IN_SCRIPT)
        self._async_write = self._async.register_script(_WRITE_SCRIPT)
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._seq = 0
        self._published = False  # whether it ever checked in (then a lost lease means loss)
        self._reopen: set[int] = set()  # gates to open once Redis answers again
        self._stopped = threading.Event()
        self.down_since: float | None = None  # wall-clock time Redis stopped answering
        try:
            self.check_in()
        except self._errors as exc:
            self._down(exc)
        self._renewer = threading.Thread(target=self._renewing, name="inflight-lease", daemon=True)
        self._renewer.start()

    # -- this process's own counts --------------------------------------------------------

    def _step(self, deployment_id: int, delta: int) -> tuple[list[str], list[str | int]]:
        with self._lock:
            left = max(self._counts.get(deployment_id, 0) + delta, 0)
            self._counts[deployment_id] = left
            self._seq += 1
            return self._keys(deployment_id), [self.process, left, self._seq]

    def _keys(self, deployment_id: int) -> list[str]:
        return [_KEY.format(deployment_id), _CLOSED.format(deployment_id)]

    def _down(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.time()
            logger.warning(
                "Redis does not answer (%s): requests are counted in this process until it "
                "is back, and no model is parked or stopped to make room meanwhile",
                type(exc).__name__,
            )

    def _up(self) -> None:
        if self.down_since is not None:
            self.down_since = None
            logger.warning("Redis answers again: in-flight counts are shared again")

    def check_in(self) -> None:
        """Renew the lease and publish every count of this process (raises RedisError)."""
        with self._lock:
            counted = sorted(self._counts.items())
            seq = self._seq
            had = self._published
            reopen = sorted(self._reopen)
        if reopen:
            self._redis.delete(*(_CLOSED.format(d) for d in reopen))
            with self._lock:
                self._reopen.difference_update(reopen)
        keys = [_LEASE + self.process, _PROCESSES, _EPOCH, _REBUILDING]
        rebuilding_ms = int((CHECK_IN_SECONDS + _CHECK_IN_SLACK_SECONDS) * 1000)
        args: list[str | int] = [self.process, int(LEASE_SECONDS * 1000), int(had), rebuilding_ms]
        for deployment_id, left in counted:
            keys.append(_KEY.format(deployment_id))
            args += [left, seq]
        self._check_in(keys=keys, args=args)
        self._published = True
        self._up()
        with self._lock:  # deployments with nothing in flight need no field any more
            for deployment_id, left in counted:
                if left == 0 and self._counts.get(deployment_id) == 0:
                    del self._counts[deployment_id]

    def _renewing(self) -> None:
        from capyctl import controlplane  # noqa: PLC0415 - it loads models; this module must import without Django set up

        noted = False  # whether this process recorded the outage (once each way)
        while not self._stopped.wait(CHECK_IN_SECONDS if self.down_since is None else 0.5):
            try:
                self.check_in()
            except self._errors as exc:
                self._down(exc)
                if not noted:
                    noted = True
                    controlplane.note_outage(True, f"{type(exc).__name__}: {exc}")
                    connection.close()  # this thread's own: none is left open
                continue
            if noted:
                noted = False
                controlplane.note_outage(False)
                connection.close()

    # -- the gateway's side ---------------------------------------------------------------

    def begin(self, deployment_id: int) -> bool:
        keys, args = self._step(deployment_id, +1)
        try:
            if self._write(keys=keys, args=[*args, 1, _TTL_SECONDS]):
                self._up()
                return True
        except self._errors as exc:
            self._down(exc)
            return True  # counted here; published when Redis is back
        self.end(deployment_id)  # the gate is closed: not counted after all
        return False

    async def abegin(self, deployment_id: int) -> bool:
        keys, args = self._step(deployment_id, +1)
        try:
            if await self._async_write(keys=keys, args=[*args, 1, _TTL_SECONDS]):
                self._up()
                return True
        except self._errors as exc:
            self._down(exc)
            return True
        await self.aend(deployment_id)
        return False

    def end(self, deployment_id: int) -> None:
        keys, args = self._step(deployment_id, -1)
        try:
            self._write(keys=keys, args=[*args, 0, _TTL_SECONDS])
        except self._errors as exc:
            self._down(exc)

    async def aend(self, deployment_id: int) -> None:
        keys, args = self._step(deployment_id, -1)
        try:
            await self._async_write(keys=keys, args=[*args, 0, _TTL_SECONDS])
        except self._errors as exc:
            self._down(exc)

    # -- the scheduler's side -------------------------------------------------------------

    def close(self, deployment_id: int) -> None:
        try:
            self._redis.set(_CLOSED.format(deployment_id), 1, ex=_TTL_SECONDS)
        except self._errors as exc:
            raise CountsUnknown(f"the drain gate could not be closed: {exc}") from exc

    def reopen(self, deployment_id: int) -> None:
        try:
            self._redis.delete(_CLOSED.format(deployment_id))
        except self._errors as exc:  # its state is ready all the same; open it when back
            self._down(exc)
            with self._lock:
                self._reopen.add(deployment_id)

    def stop(self) -> None:
        """Stop checking in (its lease then lapses): for a tracker that is done with."""
        self._stopped.set()

    def count(self, deployment_id: int) -> int:
        keys = [_KEY.format(deployment_id), _EPOCH, _REBUILDING, _PROCESSES]
        args: list[str | float] = [_LEASE, CHECK_IN_SECONDS + _CHECK_IN_SLACK_SECONDS]
        try:
            total = int(self._count(keys=keys, args=args))
        except self._errors as exc:
            raise CountsUnknown(f"Redis does not answer ({type(exc).__name__})") from exc
        if total < 0:
            raise CountsUnknown("Redis has just come back; not every process has checked in")
        return total

    def idle_seconds(self, deployment_id: int) -> float | None:
        return None  # its requests end in other processes: last_request_at says


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
