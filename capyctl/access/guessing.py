"""Guessing keys costs the guesser, not the database: the memory that the gateway's
``/v1`` and the REST API share for it.

- :class:`RecentMisses`: keys (or key ids) found missing, remembered for a few seconds in
  a bounded list, so asking again for one is answered without a read.
- :class:`FailureThrottle`: failed key checks per client address, so an address that
  keeps guessing is slowed down: its failures are answered 429. It slows guessing, never
  use: a real key gets in from a throttled address too.
- :func:`client_ip`: who the client is, behind a trusted proxy too; the gateway's and
  REST's throttle and the login's lockout count by it.

Both are bounded (the least recent go) and safe to share between threads: Django's
views run on several, the gateway on its event loop.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from django.conf import settings

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


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Hops of X-Forwarded-For read at most, from the right: past them the client is unknown.
FORWARDED_HOPS_READ = 32


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a proxy writes one (IPv6 perhaps in brackets; IPv4 mapped into IPv6
    read as IPv4), or None if ``text`` is none."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _trusted(ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None,
             proxies: Sequence[Network]) -> bool:  # fmt: skip
    return ip is not None and any(ip.version == net.version and ip in net for net in proxies)


def client_ip(
    peer: str, forwarded_for: str | None, proxies: Sequence[Network] | None = None
) -> str:
    """The client's own address. ``peer`` is who connected; only when it is one of the
    trusted proxies (``TRUSTED_PROXIES``, an allowlist) is its ``X-Forwarded-For`` read,
    from the right: the first hop that is not a trusted proxy is the client (what a
    client wrote itself is further left, and never reached). If every hop is a trusted
    proxy, the leftmost is; a hop that is no address stops the walk at the last trusted
    one, so nothing a client writes can choose its address."""
    trusted = settings.CAPYCTL["TRUSTED_PROXIES"] if proxies is None else proxies
    if not trusted or not forwarded_for:
        return peer
    nearest = _ip(peer)
    if nearest is None or not _trusted(nearest, trusted):
        return peer
    for hop in reversed(forwarded_for.split(",")[-FORWARDED_HOPS_READ:]):
        ip = _ip(hop)
        if ip is None:
            break
        if not _trusted(ip, trusted):
            return str(ip)
        nearest = ip
    return str(nearest)


def request_address(meta: Mapping[str, Any]) -> str:
    """A Django request's client address (its ``META``) as the throttles count it."""
    return address_key(client_ip(str(meta.get("REMOTE_ADDR") or ""),
                                 meta.get("HTTP_X_FORWARDED_FOR")))  # fmt: skip
