"""Guessing keys costs the guesser, not the database: the memory that the gateway's
``/v1`` and the REST API share for it.

- :class:`RecentMisses`: key ids found missing, remembered for a few seconds in a bounded
  list, so asking again for one is answered without a read.
- :class:`FailureThrottle`: failed key checks per client address, so an address that
  keeps guessing is answered 429 without a read.

Both are bounded (the least recent go) and safe to share between threads: Django's
views run on several, the gateway on its event loop.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict

MISS_SECONDS = 5.0
MISSES_KEPT = 10_000
# Each client address may fail FAILURES_ALLOWED checks at once, then one every
# FAILURE_REFILL_SECONDS; ADDRESSES_KEPT addresses are remembered (the least recent go).
FAILURES_ALLOWED = 20
FAILURE_REFILL_SECONDS = 3.0
ADDRESSES_KEPT = 16_384


class RecentMisses:
    """Names found missing, each for ``seconds`` after the read that found it."""

    def __init__(self, *, seconds: float = MISS_SECONDS, kept: int = MISSES_KEPT) -> None:
        self.seconds = seconds
        self.kept = kept
        self._found: OrderedDict[str, float] = OrderedDict()  # name → when the read began
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._found)

    def __contains__(self, name: object) -> bool:
        found = self._found.get(name)  # type: ignore[call-overload]
        return found is not None and time.monotonic() - found <= self.seconds

    def add(self, name: str, read_at: float | None = None) -> None:
        """``name`` was missing at ``read_at`` (time.monotonic(); default now)."""
        with self._lock:
            self._found[name] = time.monotonic() if read_at is None else read_at
            self._found.move_to_end(name)
            if len(self._found) > self.kept:
                self._found.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._found.clear()


class FailureThrottle:
    """Failed key checks per client address: a token bucket each, in a bounded LRU."""

    def __init__(
        self,
        *,
        allowed: int = FAILURES_ALLOWED,
        refill_seconds: float = FAILURE_REFILL_SECONDS,
        kept: int = ADDRESSES_KEPT,
    ) -> None:
        self.allowed = allowed
        self.refill_seconds = refill_seconds
        self.kept = kept
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, address: str, now: float) -> float:
        entry = self._buckets.get(address)
        if entry is None:
            return float(self.allowed)
        tokens, at = entry
        return min(float(self.allowed), tokens + (now - at) / self.refill_seconds)

    def wait(self, address: str) -> float:
        """Seconds until ``address`` may fail again (0: it may now)."""
        if not self._buckets:
            return 0.0
        tokens = self._tokens(address, time.monotonic())
        return 0.0 if tokens >= 1 else (1 - tokens) * self.refill_seconds

    def failed(self, address: str) -> None:
        with self._lock:
            now = time.monotonic()
            self._buckets[address] = (self._tokens(address, now) - 1, now)
            self._buckets.move_to_end(address)
            if len(self._buckets) > self.kept:
                self._buckets.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()


def address_key(host: str) -> str:
    """A client address as the throttle counts it: IPv6 by its /64, which one client
    usually holds whole ('' when unknown)."""
    if ":" not in host:
        return host
    try:
        return str(ipaddress.ip_network(f"{host}/64", strict=False))
    except ValueError:
        return host
