"""Per-key accounting, off the request path: requests, tokens from the response's
``usage`` (the final streamed chunk too), last use written at most once a minute; and the
limits on requests per minute and requests in flight, per key and per user."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import deque
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from capyctl.access.budgets import QUARTER
from capyctl.access.models import ApiKey, Team, Usage
from capyctl.gateway.errors import GatewayError
from capyctl.gateway.keys import KeyInfo
from capyctl.scheduler import gateway_api as scheduler

logger = logging.getLogger("capyctl.gateway")

LAST_USED_EVERY = timedelta(minutes=1)
_TAIL_BYTES = 8192
_HEAD_BYTES = 4096
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')
_PROMPT_TOKENS = re.compile(rb'"(prompt_tokens|input_tokens)"\s*:\s*(\d{1,12})')
_COMPLETION_TOKENS = re.compile(rb'"(completion_tokens|output_tokens)"\s*:\s*(\d{1,12})')


class UsageTap:
    """Watches a response as it streams by: finds its ``usage`` object at the end and,
    when asked, the id of a stored response (``resp_…``) near its start."""

    def __init__(self, *, want_response_id: bool = False) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._head = b"" if want_response_id else None
        self.response_id: str | None = None

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self._size > 4 * _TAIL_BYTES:  # trim now and then: O(1) a byte, not a copy a chunk
            tail = b"".join(self._chunks)[-_TAIL_BYTES:]
            self._chunks, self._size = [tail], len(tail)
        if self._head is not None and self.response_id is None and len(self._head) < _HEAD_BYTES:
            self._head += chunk[: _HEAD_BYTES - len(self._head)]
            found = _RESPONSE_ID.search(self._head)
            if found is not None:
                self.response_id = found.group(1).decode()

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens, or zeros when the response carried no usage.

        Chat and completions name them ``prompt_tokens``/``completion_tokens`` (at the top
        level, or in the last streamed chunk); the Responses API names them
        ``input_tokens``/``output_tokens`` inside its final ``response`` object. The last
        ``"usage"`` in the answer's tail is the one that counts."""
        tail = b"".join(self._chunks)[-_TAIL_BYTES:]
        at = tail.rfind(b'"usage"')
        if at < 0:
            return 0, 0
        rest = tail[at:]
        prompt = _PROMPT_TOKENS.search(rest)
        completion = _COMPLETION_TOKENS.search(rest)
        return (
            int(prompt.group(2)) if prompt else 0,
            int(completion.group(2)) if completion else 0,
        )


# What a usage row adds to: its key, the team it is charged to, its model, its quarter hour.
UsageCell = tuple[int, int | None, str, float]


class UsageStrip:
    """Takes the usage chunk out of a stream whose client did not ask for it: the gateway
    asks the engine for it (``stream_options.include_usage``) to count the tokens, and
    passes on every other event as it comes (an event is held only until its end)."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > _TAIL_BYTES:  # no event ends here: not one to take out
                self._held = b""
                return data
            self._held = data
            return b""
        whole, self._held = data[: end + 2], data[end + 2 :]
        if b'"usage"' not in whole:
            return whole
        return b"".join(
            event + b"\n\n" for event in whole[:-2].split(b"\n\n") if not _usage_only(event)
        )

    def rest(self) -> bytes:
        held, self._held = self._held, b""
        return b"" if _usage_only(held) else held


_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def _usage_only(event: bytes) -> bool:
    """A stream's usage chunk: usage and no choices."""
    return b'"usage"' in event and _NO_CHOICES.search(event) is not None


class UsageBook:
    """Counts per key, team, model and quarter hour in memory; :meth:`flush` writes them in
    one go (once a second): [requests, prompt and completion tokens, GPU-seconds, switch
    GPU-seconds, spend]."""

    def __init__(self) -> None:
        self._pending: dict[UsageCell, list[float]] = {}
        self._flushing = False

    def add(
        self, key_pk: int, prompt_tokens: int, completion_tokens: int, *, model: str = "",
        team_id: int | None = None, gpu_seconds: float = 0.0, switch_gpu_seconds: float = 0.0,
        spend: float = 0.0, at: float | None = None,
    ) -> None:  # fmt: skip
        """One request's usage, in the quarter hour of ``at`` (when it began; default now)."""
        when = time.time() if at is None else at
        cell = (key_pk, team_id, model, when - when % QUARTER)
        counts = self._pending.setdefault(cell, [0, 0, 0, 0.0, 0.0, 0.0])
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens
        counts[3] += gpu_seconds
        counts[4] += switch_gpu_seconds
        counts[5] += spend

    def take(self) -> dict[UsageCell, list[float]]:
        pending, self._pending = self._pending, {}
        return pending

    def put_back(self, pending: dict[UsageCell, list[float]]) -> None:
        """Counts taken but not written (the database did not answer): kept for the next."""
        for cell, added in pending.items():
            counts = self._pending.setdefault(cell, [0, 0, 0, 0.0, 0.0, 0.0])
            for at, value in enumerate(added):
                counts[at] += value


def write_usage(pending: dict[UsageCell, list[float]]) -> None:
    """Add the counted requests, tokens and GPU-seconds to their keys and their usage rows
    (runs on a worker thread), in one transaction: a batch that fails is written not at
    all, so it can be tried again whole without counting any of it twice. Rows are
    updated in order, so two processes writing the same ones at once wait for each other
    rather than deadlock."""
    try:
        now = timezone.now()
        per_key: dict[int, list[int]] = {}
        for (key_pk, _, _, _), counts in pending.items():
            totals = per_key.setdefault(key_pk, [0, 0, 0])
            for at in range(3):
                totals[at] += int(counts[at])
        with transaction.atomic():
            keys = set(ApiKey.objects.filter(pk__in=list(per_key)).values_list("pk", flat=True))
            teams = {team for (_, team, _, _) in pending if team is not None}
            teams = set(Team.objects.filter(pk__in=teams).values_list("pk", flat=True))
            for key_pk, (requests, prompt, completion) in sorted(per_key.items()):
                ApiKey.objects.filter(pk=key_pk).update(
                    request_count=F("request_count") + requests,
                    prompt_tokens=F("prompt_tokens") + prompt,
                    completion_tokens=F("completion_tokens") + completion,
                )
            ApiKey.objects.filter(pk__in=list(per_key)).filter(
                Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_EVERY)
            ).update(last_used_at=now)
            order = sorted(pending.items(), key=lambda item: (item[0][3], item[0][0], item[0][2]))
            for (key_pk, team_id, model, quarter), counts in order:
                if key_pk not in keys:  # removed (its user removed) while it was in flight
                    logger.info("usage of a key removed meanwhile (%d) left out", key_pk)
                    continue
                charged = team_id if team_id in teams else None  # a team removed meanwhile
                _add_usage(key_pk, charged, model, datetime.fromtimestamp(quarter, UTC), counts)
    finally:
        connection.close()


def _add_usage(
    key_pk: int, team_id: int | None, model: str, at: datetime, counts: list[float]
) -> None:
    requests, prompt, completion, gpu, switch, spend = counts
    change = {
        "requests": F("requests") + int(requests),
        "prompt_tokens": F("prompt_tokens") + int(prompt),
        "completion_tokens": F("completion_tokens") + int(completion),
        "gpu_seconds": F("gpu_seconds") + gpu,
        "switch_gpu_seconds": F("switch_gpu_seconds") + switch,
        "spend": F("spend") + spend,
    }
    # The row's first copy: two processes that made it at once made two, and sums of them
    # stay right (nothing reads one row alone).
    first = (
        Usage.objects.filter(at=at, key_id=key_pk, model=model)
        .filter(Q(team__isnull=True) if team_id is None else Q(team_id=team_id))
        .order_by("pk")
        .values_list("pk", flat=True)
        .first()
    )
    if first is not None:
        Usage.objects.filter(pk=first).update(**change)
        return
    Usage.objects.create(at=at, key_id=key_pk, model=model, team_id=team_id,
                         requests=int(requests), prompt_tokens=int(prompt),
                         completion_tokens=int(completion), gpu_seconds=gpu,
                         switch_gpu_seconds=switch, spend=spend)  # fmt: skip


Bucket = tuple[str, int]  # ("key", pk) or ("user", id): what a limit counts


class RateLimiter:
    """Sliding one-minute windows per bucket, in this process (standalone)."""

    def __init__(self) -> None:
        self._hits: dict[Bucket, deque[float]] = {}

    def retry_after(self, key_pk: int, limit: int | None) -> float | None:
        """Seconds to wait when the key is over its limit (and count this request if not)."""
        refused = self.admit([(("key", key_pk), limit)])
        return None if refused is None else refused[1]

    def admit(self, limits: list[tuple[Bucket, int | None]]) -> tuple[int, float] | None:
        """Count this request in every window, or, when one is full, in none: then the
        index of the full one and the seconds to wait."""
        now = time.monotonic()
        counted = []
        for at, (bucket, limit) in enumerate(limits):
            if not limit:
                continue
            hits = self._hits.setdefault(bucket, deque())
            while hits and now - hits[0] >= 60:
                hits.popleft()
            if len(hits) >= limit:
                return at, max(60 - (now - hits[0]), 1.0)
            counted.append(hits)
        for hits in counted:
            hits.append(now)
        return None


class InFlight:
    """Requests in flight per bucket, in this process (standalone)."""

    def __init__(self) -> None:
        self._counts: dict[Bucket, int] = {}

    def enter(self, limits: list[tuple[Bucket, int | None]]) -> int | None:
        """Count one more request in every bucket, or, when one is full, in none and
        return its index."""
        for at, (bucket, limit) in enumerate(limits):
            if limit and self._counts.get(bucket, 0) >= limit:
                return at
        for bucket, _ in limits:
            self._counts[bucket] = self._counts.get(bucket, 0) + 1
        return None

    def leave(self, limits: list[tuple[Bucket, int | None]]) -> None:
        for bucket, _ in limits:
            left = self._counts.get(bucket, 0) - 1
            if left > 0:
                self._counts[bucket] = left
            else:
                self._counts.pop(bucket, None)


# Every window is checked before any is counted, so a request refused by one counts in none.
_LIMIT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - 60)
  if redis.call('ZCARD', key) >= tonumber(ARGV[i]) then
    local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    return {i, tostring(60 - (now - tonumber(oldest[2])))}
  end
end
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now, ARGV[#KEYS + 1])
  redis.call('EXPIRE', key, 61)
end
return false
"""

# Requests in flight: one member each, dropped when it ends; one older than the lease
# (a process that died mid-request) stops counting by itself.
_ENTER_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[#KEYS + 2])
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - lease)
  if redis.call('ZCARD', key) >= tonumber(ARGV[i]) then
    return i
  end
end
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now, ARGV[#KEYS + 1])
  redis.call('EXPIRE', key, math.ceil(lease))
end
return false
"""
IN_FLIGHT_LEASE_SECONDS = 3600


def _redis_key(kind: str, bucket: Bucket) -> str:
    return (
        f"capyctl:{kind}:{bucket[1]}" if bucket[0] == "key" else f"capyctl:{kind}:user:{bucket[1]}"
    )


class _Quiet(Exception):  # noqa: N818 - a path, not a fault
    """Redis is not asked now (its quiet period)."""


class RedisRateLimiter:
    """The same windows and counts, kept in Redis (server mode): every API process counts
    against one window per key and per user, by Redis's clock, in one atomic step.

    While Redis does not answer, this process counts alone (its own windows and requests
    in flight, as standalone does), so limits hold per process rather than across them;
    a request that ends meanwhile is taken out of Redis's count once Redis is back.
    """

    def __init__(self, url: str) -> None:
        # On the request path: short timeouts, and no call for a while once one did not
        # answer (the scheduler's quiet period, shared by every Redis call of the process).
        self._redis = scheduler.redis_async_client(url)
        self._script = self._redis.register_script(_LIMIT_SCRIPT)
        self._enter = self._redis.register_script(_ENTER_SCRIPT)
        self._errors = scheduler.redis_errors()
        self._link = scheduler.redis_link(url)
        self._local = LocalLimiter()
        self._entered_here: set[str] = set()  # members counted by this process alone
        self._leaves_owed: list[tuple[str, str]] = []  # (key, member) to remove when back
        self.down_since: float | None = None

    def _down(self, exc: BaseException) -> None:
        self._link.failed(exc)
        if self.down_since is None:
            self.down_since = time.time()
            logger.warning("Redis does not answer (%s): limits count in this process alone",
                           type(exc).__name__)  # fmt: skip

    async def _up(self) -> None:
        self.down_since = None
        owed, self._leaves_owed = self._leaves_owed, []
        for key, member in owed:
            try:
                await self._redis.zrem(key, member)
            except self._errors:
                self._leaves_owed.append((key, member))

    async def retry_after(self, key_pk: int, limit: int | None) -> float | None:
        refused = await self.admit([(("key", key_pk), limit)])
        return None if refused is None else refused[1]

    async def admit(self, limits: list[tuple[Bucket, int | None]]) -> tuple[int, float] | None:
        live = [(at, bucket, limit) for at, (bucket, limit) in enumerate(limits) if limit]
        if not live:
            return None
        member = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        if not self._link.answers():
            return await self._local.admit(limits)
        try:
            refused = await self._script(
                keys=[_redis_key("rpm", bucket) for _, bucket, _ in live],
                args=[*(limit for _, _, limit in live), member],
            )
        except self._errors as exc:
            self._down(exc)
            return await self._local.admit(limits)
        if self.down_since is not None or self._leaves_owed:
            await self._up()
        if refused is None:
            return None
        return live[int(refused[0]) - 1][0], max(float(refused[1]), 1.0)

    async def enter(self, limits: list[tuple[Bucket, int | None]], member: str) -> int | None:
        live = [(at, bucket, limit) for at, (bucket, limit) in enumerate(limits) if limit]
        if not live:
            return None
        try:
            if not self._link.answers():
                raise _Quiet
            refused = await self._enter(
                keys=[_redis_key("busy", bucket) for _, bucket, _ in live],
                args=[*(limit for _, _, limit in live), member, IN_FLIGHT_LEASE_SECONDS],
            )
        except _Quiet:
            full = await self._local.enter(limits, member)
            if full is None:
                self._entered_here.add(member)
            return full
        except self._errors as exc:
            self._down(exc)
            full = await self._local.enter(limits, member)
            if full is None:
                self._entered_here.add(member)
            return full
        if self.down_since is not None or self._leaves_owed:
            await self._up()
        return None if refused is None else live[int(refused) - 1][0]

    async def leave(self, limits: list[tuple[Bucket, int | None]], member: str) -> None:
        if member in self._entered_here:
            self._entered_here.discard(member)
            await self._local.leave(limits, member)
            return
        for bucket, limit in limits:
            if limit:
                key = _redis_key("busy", bucket)
                if not self._link.answers():
                    self._leaves_owed.append((key, member))
                    continue
                try:
                    await self._redis.zrem(key, member)
                except self._errors as exc:
                    self._down(exc)
                    self._leaves_owed.append((key, member))

    async def close(self) -> None:
        await self._redis.aclose()


class LocalLimiter:
    """:class:`RateLimiter` and :class:`InFlight` behind the face of
    :class:`RedisRateLimiter`."""

    def __init__(self) -> None:
        self._window = RateLimiter()
        self._in_flight = InFlight()

    async def retry_after(self, key_pk: int, limit: int | None) -> float | None:
        return self._window.retry_after(key_pk, limit)

    async def admit(self, limits: list[tuple[Bucket, int | None]]) -> tuple[int, float] | None:
        return self._window.admit(limits)

    async def enter(self, limits: list[tuple[Bucket, int | None]], member: str) -> int | None:
        return self._in_flight.enter(limits)

    async def leave(self, limits: list[tuple[Bucket, int | None]], member: str) -> None:
        self._in_flight.leave(limits)

    async def close(self) -> None:
        return None


class Limits:
    """A key's rate and concurrency limits, and its user's, which all their keys share
    (so making more keys does not raise the ceiling)."""

    def __init__(self, counter: LocalLimiter | RedisRateLimiter) -> None:
        self.counter = counter

    async def admit(self, key: KeyInfo) -> str | None:
        """Count the request in its key's and user's limits; returns a token for
        :meth:`leave` (None: no concurrency limit). Raises a 429 when a limit is full."""
        rates = [(("key", key.pk), key.requests_per_minute),
                 (("user", key.user_id), key.user_requests_per_minute)]  # fmt: skip
        refused = await self.counter.admit(rates)
        if refused is not None:
            whose, wait = refused
            limit = rates[whose][1]
            raise GatewayError(
                429,
                "rate_limited",
                f"This key allows {limit} requests per minute."
                if whose == 0
                else f"This key's user allows {limit} requests per minute across all keys.",
                "rate_limit_error",
                headers=[(b"retry-after", str(int(wait + 0.999)).encode())],
            )
        busy = _busy(key)
        if not any(limit for _, limit in busy):
            return None
        member = uuid.uuid4().hex
        full = await self.counter.enter(busy, member)
        if full is not None:
            limit = busy[full][1]
            raise GatewayError(
                429,
                "concurrency_limited",
                f"This key allows {limit} requests at once; wait for one to finish."
                if full == 0
                else f"This key's user allows {limit} requests at once across all keys; "
                "wait for one to finish.",
                "rate_limit_error",
                headers=[(b"retry-after", b"1")],
            )
        return member

    async def leave(self, key: KeyInfo, member: str | None) -> None:
        """The request admitted with ``member`` has ended."""
        if member is not None:
            await self.counter.leave(_busy(key), member)

    async def close(self) -> None:
        await self.counter.close()


def _busy(key: KeyInfo) -> list[tuple[Bucket, int | None]]:
    return [(("key", key.pk), key.max_concurrent), (("user", key.user_id), key.user_max_concurrent)]


def make_limiter(redis_url: str | None) -> Limits:
    return Limits(RedisRateLimiter(redis_url) if redis_url else LocalLimiter())
