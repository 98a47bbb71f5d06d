"""Per-key accounting, off the request path: requests, tokens from the response's
``usage`` (the final streamed chunk too), last use written at most once a minute, and
the requests-per-minute limit."""

from __future__ import annotations

import json
import time
from collections import deque
from datetime import timedelta

from django.db import connection
from django.db.models import F, Q
from django.utils import timezone

from capyctl.access.models import ApiKey

LAST_USED_EVERY = timedelta(minutes=1)
_TAIL_BYTES = 8192


class UsageTap:
    """Watches a response as it streams by and finds its ``usage`` object at the end."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk)[-_TAIL_BYTES:]

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens, or zeros when the response carried no usage."""
        text = self._tail.decode("utf-8", "replace")
        candidates = [text] if text.lstrip().startswith("{") else []
        candidates += [
            line.removeprefix("data: ")
            for line in reversed(text.splitlines())
            if line.startswith("data: {") and '"usage"' in line
        ]
        for candidate in candidates:
            try:
                usage = json.loads(candidate).get("usage") or {}
            except (json.JSONDecodeError, AttributeError):
                continue
            prompt = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            completion = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
            return prompt, completion
        return 0, 0


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
    """A sliding one-minute window per key, in this process."""

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
