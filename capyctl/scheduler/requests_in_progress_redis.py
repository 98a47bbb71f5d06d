"""Requests in flight per deployment, counted in Redis: server mode's shared counter.

Every process of server mode (``CAPYCTL_REDIS_URL``) counts its own requests here and
shares them through Redis, and the drain gate (:mod:`capyctl.scheduler.requests_in_progress`)
is a Redis key that the same atomic step that counts checks.

Each process publishes its own count of a deployment's requests as one field of the
deployment's hash, ``count:seq``: the count it knows exactly, numbered, so a late write
never replaces a newer one. Every process checks in each second (its lease renewed, all
its counts published again). When Redis does not answer, a process goes on counting its
own requests (ready models keep answering) and publishes them the moment Redis answers it
again. A count is a sum only when it can miss nothing; else :meth:`RedisInFlight.count`
raises :class:`CountsUnknown`, and no drain takes it for zero:

- Redis lost its data (its epoch is gone): until every live process has had the time to
  check in again; a new Redis looks the same, so its first seconds are unknown too.
- Nobody checked in for :data:`GAP_SECONDS` (Redis was stopped, paused or cut off from
  everyone, whatever it kept): the same.
- A process has not checked in for :data:`STALE_SECONDS`, or wrote while it had counts
  Redis lacked: until it checks in, unless it is known dead. A process on this machine is
  checked by its pid (:mod:`capyctl.scheduler.redislink`), so a crashed one's counts
  vanish at once, and one that is alive but cut off from Redis (a partition, a pause)
  keeps the counts unknown however long it lasts. One on another machine is taken for
  dead only :data:`PRESUMED_GONE_SECONDS` after its lease lapsed with Redis answering.

Calls on the request path and under the host lock have short timeouts and share a quiet
period once Redis did not answer (:mod:`capyctl.scheduler.redislink`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import uuid
from typing import Any

from django.db import connection

from capyctl.scheduler import redislink
from capyctl.scheduler.errors import ControlPlaneUnavailableError

logger = logging.getLogger("capyctl.scheduler")

_KEY = "capyctl:inflight:{}"  # a hash: process id -> "count:seq" of that process
_CLOSED = "capyctl:inflight-closed:{}"
_LEASE = "capyctl:inflight-lease:"  # + process id: exists while that process checks in
# Sorted set: process id -> when it last checked in (0: it may hold counts Redis lacks).
_PROCESSES = "capyctl:inflight-processes"
_EPOCH = "capyctl:inflight-epoch"  # made with the first lease; gone: Redis lost every count
_REBUILDING = "capyctl:inflight-rebuilding"  # counts being published again after a loss
_LAST = "capyctl:inflight-last"  # when any process last checked in
_WHO = "capyctl:inflight-who"  # a hash: process id -> its identity (redislink.identity)
_LAPSED = "capyctl:inflight-lapsed"  # a hash: process id -> when its lapse was first seen
_TTL_SECONDS = 3600  # a gate closed by a process that died cannot pin a model forever
# A process checks in (renews its lease, publishes its counts) every CHECK_IN_SECONDS, and
# every RETRY_SECONDS while Redis does not answer it or it has counts Redis lacks.
LEASE_SECONDS = 5
CHECK_IN_SECONDS = 1.0
RETRY_SECONDS = 0.1
# A process that has not checked in for this long may hold counts Redis lacks.
STALE_SECONDS = 3.0
# Nobody checked in for this long: Redis was away; every process gets the time to check
# in again (REBUILDING_SECONDS) before a count is trusted.
GAP_SECONDS = 2.0
REBUILDING_SECONDS = 3.0
# A process nobody can check (another machine) whose lease lapsed while Redis answered is
# taken for dead after this long.
PRESUMED_GONE_SECONDS = 30.0

# KEYS: the hash, the gate, processes, who; ARGV: process, count, seq, check the gate
# (1/0), ttl, counts Redis may lack (1/0), identity.
_WRITE_SCRIPT = """
if ARGV[6] == '1' then
  redis.call('ZADD', KEYS[3], 0, ARGV[1])
else
  redis.call('ZADD', KEYS[3], 'NX', 0, ARGV[1])
end
redis.call('HSETNX', KEYS[4], ARGV[1], ARGV[7])
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
# {total} when the counts can be trusted; {-1} when not (Redis lost its data or was away,
# and not every process has had the time to check in); {-2, process, identity, ...}: these
# processes have not checked in lately, and only their callers can tell whether they run.
# KEYS: the hash, epoch, rebuilding, processes, last, who, lapsed; ARGV: lease prefix,
# stale after, gap, rebuilding (ms), presumed gone after (seconds).
_COUNT_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('EXISTS', KEYS[3]) == 1 then
  return {-1}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local last = tonumber(redis.call('GET', KEYS[5]))
if last and now - last > tonumber(ARGV[3]) then
  redis.call('SET', KEYS[3], 1, 'PX', ARGV[4])
  redis.call('SET', KEYS[5], now)
  return {-1}
end
local suspects = {-2}
for _, process in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]))) do
  local gone = false
  if redis.call('EXISTS', ARGV[1] .. process) == 0 then
    local first = tonumber(redis.call('HGET', KEYS[7], process))
    if not first then
      redis.call('HSET', KEYS[7], process, now)
    elseif now - first >= tonumber(ARGV[5]) then
      gone = true
    end
  end
  if gone then
    redis.call('ZREM', KEYS[4], process)
    redis.call('HDEL', KEYS[6], process)
    redis.call('HDEL', KEYS[7], process)
  else
    table.insert(suspects, process)
    table.insert(suspects, redis.call('HGET', KEYS[6], process) or '')
  end
end
if #suspects > 1 then return suspects end
local total = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if redis.call('ZSCORE', KEYS[4], fields[i]) then
    total = total + math.max(tonumber(string.match(fields[i + 1], '^(%-?%d+)')) or 0, 0)
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
return {total}
"""
# A process known dead (or done) leaves: its counts stop counting.
# KEYS: processes, who, lapsed, lease; ARGV: process.
_LEAVE_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
"""
# A process checks in: its lease renewed, its counts published again (a write older than
# what is there changes nothing). Counts are untrusted for a while, time enough for every
# live process to check in, when the epoch is missing (a Redis that lost its data looks
# like a new one: whoever checks in first, even a process started since, cannot tell, and
# others may have requests in flight), when nobody checked in for the gap (Redis was away
# from everyone, whatever it kept), and when a process that had a lease finds it gone
# (it was cut off past its lease). KEYS: lease, processes, epoch, rebuilding, last, who,
# lapsed, then the hashes; ARGV: process, lease (ms), had a lease (1/0), rebuilding (ms),
# gap (seconds), identity, then count, seq pairs.
_CHECK_IN_SCRIPT = """
local had = redis.call('EXISTS', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local last = tonumber(redis.call('GET', KEYS[5]))
redis.call('SET', KEYS[1], 1, 'PX', ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SET', KEYS[3], now)
  redis.call('SET', KEYS[4], 1, 'PX', ARGV[4])
elseif (had == 0 and ARGV[3] == '1') or (last and now - last > tonumber(ARGV[5])) then
  redis.call('SET', KEYS[4], 1, 'PX', ARGV[4])
end
redis.call('SET', KEYS[5], now)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HSET', KEYS[6], ARGV[1], ARGV[6])
redis.call('HDEL', KEYS[7], ARGV[1])
for i = 8, #KEYS do
  local count = ARGV[(i - 8) * 2 + 7]
  local seq = tonumber(ARGV[(i - 8) * 2 + 8])
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


class RedisInFlight:
    """Counts shared by every process through Redis; see the module's docstring.

    Every count is this process's own, kept here first and published after; a Redis that
    does not answer costs no request, only the trust in the shared counts.
    """

    def __init__(self, url: str) -> None:
        self.process = uuid.uuid4().hex
        self._errors = redislink.errors()
        self._link = redislink.link(url)
        self._redis = redislink.client(url)  # the request path and the host lock's
        self._async = redislink.async_client(url)
        self._background = redislink.client(url, redislink.BACKGROUND_TIMEOUT_SECONDS)
        self._write = self._redis.register_script(_WRITE_SCRIPT)
        self._count = self._redis.register_script(_COUNT_SCRIPT)
        self._leave = self._redis.register_script(_LEAVE_SCRIPT)
        self._check_in = self._background.register_script(_CHECK_IN_SCRIPT)
        self._async_write = self._async.register_script(_WRITE_SCRIPT)
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._seq = 0
        self._lacking = False  # Redis may lack some of its counts (a write did not reach it)
        self._published = False  # whether it ever checked in (then a lost lease means loss)
        self._reopen: set[int] = set()  # gates to open once Redis answers again
        self._stopped = threading.Event()
        self._nudge = threading.Event()  # check in now
        self.down_since: float | None = None  # wall-clock time Redis stopped answering
        try:
            self.check_in()
        except self._errors as exc:
            self._failed(exc)
        self._renewer = threading.Thread(target=self._renewing, name="inflight-lease", daemon=True)
        self._renewer.start()
        atexit.register(self.stop)

    # -- this process's own counts --------------------------------------------------------

    def _step(self, deployment_id: int, delta: int, gate: int) -> tuple[list[str], list[Any]]:
        with self._lock:
            left = max(self._counts.get(deployment_id, 0) + delta, 0)
            self._counts[deployment_id] = left
            self._seq += 1
            keys = [_KEY.format(deployment_id), _CLOSED.format(deployment_id), _PROCESSES, _WHO]
            args = [self.process, left, self._seq, gate, _TTL_SECONDS, int(self._lacking),
                    redislink.identity()]  # fmt: skip
            return keys, args

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

    def _failed(self, exc: BaseException) -> None:
        """A call did not reach Redis: its count is published at the next check-in, which
        comes soon."""
        self._link.failed(exc)
        self._down(exc)
        self._lacking = True
        self._nudge.set()

    def _unsent(self) -> None:
        """A step counted here only (the quiet period): published at the next check-in."""
        self._lacking = True
        self._nudge.set()

    def _sent(self) -> None:
        if self._lacking or self.down_since is not None:
            self._nudge.set()  # Redis answers again: publish the rest now

    def check_in(self) -> None:
        """Renew the lease and publish every count of this process (raises RedisError)."""
        with self._lock:
            counted = sorted(self._counts.items())
            seq = self._seq
            had = self._published
            reopen = sorted(self._reopen)
            lacking, self._lacking = self._lacking, False
        try:
            if reopen:
                self._background.delete(*(_CLOSED.format(d) for d in reopen))
                with self._lock:
                    self._reopen.difference_update(reopen)
            keys = [_LEASE + self.process, _PROCESSES, _EPOCH, _REBUILDING, _LAST, _WHO, _LAPSED]
            args: list[str | int | float] = [
                self.process, int(LEASE_SECONDS * 1000), int(had),
                int(REBUILDING_SECONDS * 1000), GAP_SECONDS, redislink.identity(),
            ]  # fmt: skip
            for deployment_id, left in counted:
                keys.append(_KEY.format(deployment_id))
                args += [left, seq]
            self._check_in(keys=keys, args=args)
        except BaseException:
            self._lacking = self._lacking or lacking
            raise
        self._published = True
        self._link.answered()
        self._up()
        with self._lock:  # deployments with nothing in flight need no field any more
            for deployment_id, left in counted:
                if left == 0 and self._counts.get(deployment_id) == 0:
                    del self._counts[deployment_id]

    def _renewing(self) -> None:
        from capyctl import controlplane  # noqa: PLC0415 - it loads models; this module must import without Django set up

        noted = False  # whether this process recorded the outage (once each way)
        while not self._stopped.is_set():
            calm = self.down_since is None and not self._lacking
            self._nudge.wait(CHECK_IN_SECONDS if calm else RETRY_SECONDS)
            self._nudge.clear()
            if self._stopped.is_set():
                return
            try:
                self.check_in()
            except self._errors as exc:
                self._failed(exc)
                self._nudge.clear()  # the next try after RETRY_SECONDS
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
        keys, args = self._step(deployment_id, +1, 1)
        if not self._link.answers():
            self._unsent()
            return True  # counted here; published when Redis is back
        try:
            admitted = self._write(keys=keys, args=args)
        except self._errors as exc:
            self._failed(exc)
            return True
        self._sent()
        if admitted:
            return True
        self.end(deployment_id)  # the gate is closed: not counted after all
        return False

    async def abegin(self, deployment_id: int) -> bool:
        keys, args = self._step(deployment_id, +1, 1)
        if not self._link.answers():
            self._unsent()
            return True
        try:
            admitted = await self._async_write(keys=keys, args=args)
        except self._errors as exc:
            self._failed(exc)
            return True
        self._sent()
        if admitted:
            return True
        await self.aend(deployment_id)
        return False

    def end(self, deployment_id: int) -> None:
        keys, args = self._step(deployment_id, -1, 0)
        if not self._link.answers():
            self._unsent()
            return
        try:
            self._write(keys=keys, args=args)
        except self._errors as exc:
            self._failed(exc)
            return
        self._sent()

    async def aend(self, deployment_id: int) -> None:
        keys, args = self._step(deployment_id, -1, 0)
        if not self._link.answers():
            self._unsent()
            return
        try:
            await self._async_write(keys=keys, args=args)
        except self._errors as exc:
            self._failed(exc)
            return
        self._sent()

    # -- the scheduler's side -------------------------------------------------------------

    def close(self, deployment_id: int) -> None:
        with self._lock:  # a drain again: an opening still owed is not
            self._reopen.discard(deployment_id)
        if not self._link.answers():
            raise CountsUnknown("the drain gate could not be closed: Redis did not answer lately")
        try:
            self._redis.set(_CLOSED.format(deployment_id), 1, ex=_TTL_SECONDS)
        except self._errors as exc:
            self._failed(exc)
            raise CountsUnknown(f"the drain gate could not be closed: {exc}") from exc

    def reopen(self, deployment_id: int) -> None:
        if self._link.answers():
            try:
                self._redis.delete(_CLOSED.format(deployment_id))
                return
            except self._errors as exc:
                self._failed(exc)
        with self._lock:  # its state is ready all the same; opened when Redis answers
            self._reopen.add(deployment_id)

    def stop(self) -> None:
        """Stop checking in and leave: for a tracker that is done with (and at exit)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._nudge.set()
        with contextlib.suppress(*self._errors):
            self._leave(keys=self._leaving_keys(), args=[self.process])

    def _leaving_keys(self, process: str | None = None) -> list[str]:
        return [_PROCESSES, _WHO, _LAPSED, _LEASE + (process or self.process)]

    def count(self, deployment_id: int) -> int:
        if not self._link.answers():
            raise CountsUnknown("Redis did not answer lately")
        keys = [_KEY.format(deployment_id), _EPOCH, _REBUILDING, _PROCESSES, _LAST, _WHO, _LAPSED]
        args = [_LEASE, STALE_SECONDS, GAP_SECONDS, int(REBUILDING_SECONDS * 1000),
                PRESUMED_GONE_SECONDS]  # fmt: skip
        for _attempt in range(2):
            try:
                code, *suspects = self._count(keys, args)
            except self._errors as exc:
                self._failed(exc)
                raise CountsUnknown(f"Redis does not answer ({type(exc).__name__})") from exc
            if int(code) >= 0:
                return int(code)
            if int(code) == -1:
                raise CountsUnknown("Redis has just come back; not every process has checked in")
            silent = self._silent(suspects)
            if silent:
                raise CountsUnknown(
                    f"{redislink.describe(silent)} has not published its counts lately (cut "
                    "off from Redis?); its requests may be missing"
                )
        raise CountsUnknown("processes that are gone are still being removed")

    def _silent(self, suspects: list[bytes]) -> bytes | None:
        """Of processes that have not checked in lately, one that may still run (None:
        every one is known dead, and has been removed)."""
        living = None
        for process, who in zip(suspects[0::2], suspects[1::2], strict=True):
            if redislink.alive(who) is False:
                try:
                    self._leave(keys=self._leaving_keys(process.decode()), args=[process])
                except self._errors as exc:
                    self._failed(exc)
                    return who
                logger.info("in-flight counts of %s dropped: it is gone",
                            redislink.describe(who))  # fmt: skip
            else:
                living = who
        return living

    def idle_seconds(self, deployment_id: int) -> float | None:
        return None  # its requests end in other processes: last_request_at says
