"""Per-key accounting, off the request path: requests, tokens from the response's
``usage`` (the final streamed chunk too), last use written at most once a minute, and
the requests-per-minute limit."""

from __future__ import annotations

import re
import time
import uuid
from collections import deque
from datetime import timedelta

from django.db import connection
from django.db.models import F, Q
from django.utils import timezone

from capyctl.access.models import ApiKey

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


class UsageBook:
    """Counts per key in memory; :meth:`flush` writes them in one go (once a second)."""

    def __init__(self) -> None:
        self._pending: dict[int, list[int]] = {}
        self._flushing = False

    def add(self, key_pk: int, prompt_tokens: int, completion_tokens: int) -> None:
        counts = self._pending.setdefault(key_pk, [0, 0, 0])
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens

    def take(self) -> dict[int, list[int]]:
        pending, self._pending = self._pending, {}
        return pending


def write_usage(pending: dict[int, list[int]]) -> None:
    """Add the counted requests and tokens to their keys (runs on a worker thread)."""
    try:
        now = timezone.now()
        for key_pk, (requests, prompt, completion) in pending.items():
            ApiKey.objects.filter(pk=key_pk).update(
                request_count=F("request_count") + requests,
                prompt_tokens=F("prompt_tokens") + prompt,
                completion_tokens=F("completion_tokens") + completion,
            )
        ApiKey.objects.filter(pk__in=list(pending)).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_EVERY)
        ).update(last_used_at=now)
    finally:
        connection.close()


class RateLimiter:
    """A sliding one-minute window per key, in this process (standalone)."""

    def __init__(self) -> None:
        self._hits: dict[int, deque[float]] = {}

    def retry_after(self, key_pk: int, limit: int | None) -> float | None:
        """Seconds to wait when the key is over its limit (and count this request if not)."""
        if not limit:
            return None
        now = time.monotonic()
        hits = self._hits.setdefault(key_pk, deque())
        while hits and now - hits[0] >= 60:
            hits.popleft()
        if len(hits) >= limit:
            return max(60 - (now - hits[0]), 1.0)
        hits.append(now)
        return None


_LIMIT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(60 - (now - tonumber(oldest[2])))
end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('EXPIRE', KEYS[1], 61)
return false
"""


class RedisRateLimiter:
    """The same sliding window, kept in Redis (server mode): every API process counts
    against one window per key, by Redis's clock, in one atomic step a request."""

    def __init__(self, url: str) -> None:
        import redis.asyncio

        self._redis = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        self._script = self._redis.register_script(_LIMIT_SCRIPT)

    async def retry_after(self, key_pk: int, limit: int | None) -> float | None:
        if not limit:
            return None
        member = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        wait = await self._script(keys=[f"capyctl:rpm:{key_pk}"], args=[limit, member])
        return None if wait is None else max(float(wait), 1.0)

    async def close(self) -> None:
        await self._redis.aclose()


class LocalLimiter:
    """:class:`RateLimiter` behind the same awaitable face as :class:`RedisRateLimiter`."""

    def __init__(self) -> None:
        self._window = RateLimiter()

    async def retry_after(self, key_pk: int, limit: int | None) -> float | None:
        return self._window.retry_after(key_pk, limit)

    async def close(self) -> None:
        return None


def make_limiter(redis_url: str | None) -> LocalLimiter | RedisRateLimiter:
    return RedisRateLimiter(redis_url) if redis_url else LocalLimiter()
