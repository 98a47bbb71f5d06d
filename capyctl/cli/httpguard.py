"""Uvicorn's HTTP protocol with bounds on what one client can hold.

Uvicorn itself has no timeout for a request's head or body and no cap on one client's
connections: a client that sends nothing, or a byte every few seconds, holds a connection
(and a place under ``limit_concurrency``) for as long as it likes. Here:

- A request's head must arrive within ``header_timeout`` seconds of the connection (or of
  the request's first byte, on a kept-alive connection) and in at most
  ``max_header_bytes``, every byte of it counted however it arrives: else 408 or 431.
- Its body must arrive within ``body_timeout`` seconds of the head, plus a second for
  every ``body_min_rate`` bytes that arrive (the clock waits while the server itself is
  not reading): else 408.
- One client address (IPv6: its /64) holds at most ``per_address`` connections that are
  not carrying a ``/v1`` request with a well-formed key. One more may still show such a
  key in its head (an app's pool of connections opens them all at once, before any head
  is read); a head without one is answered 429 and closed, and until its head is in it
  counts against no one else's share. An app's pool of keyed connections is
  not capped (the gateway answers a wrong key at once, and the guessed-key throttle slows
  those who keep trying). A trusted proxy's address has no cap.
- A request is admitted while fewer than ``max_connections - keyed_reserve`` requests run
  (and as many connections are open); past that, only ``/v1`` requests carrying a
  well-formed key are, up to ``max_connections`` running requests. The rest get 503.
  The gateway answers a wrong key at once, so guessers do not hold the share kept for
  keys.

Once the head is in and the body has arrived, nothing changes: a long answer (a stream)
is not cut short.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A /v1 request that may use the share kept for keys: its key has the shape of one this
# server makes (capyctl.access.services), in either header the gateway reads.
_KEYED = re.compile(rb"(?:bearer\s+)?capy_[a-z0-9]{10}_[A-Za-z0-9_-]{43}\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Bounds:
    header_timeout: float
    max_header_bytes: int
    body_timeout: float
    body_min_rate: int  # bytes a second; 0: the whole body within body_timeout
    max_connections: int
    per_address: int  # 0: no cap
    keyed_reserve: int  # of max_connections, for /v1 requests with a well-formed key
    # Trusted proxies speak for many clients: no per-address cap for them.
    uncapped: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()


def bounds_from_settings(values: dict[str, Any]) -> Bounds:
    """The bounds that ``settings.CAPYCTL`` sets (docs/configuration.md)."""
    most = int(values["HTTP_MAX_CONNECTIONS"])
    return Bounds(
        header_timeout=float(values["HTTP_HEADER_TIMEOUT"]),
        max_header_bytes=int(values["HTTP_MAX_HEADER_BYTES"]),
        body_timeout=float(values["HTTP_BODY_TIMEOUT"]),
        body_min_rate=int(values["HTTP_BODY_MIN_RATE"]),
        max_connections=most,
        per_address=int(values["HTTP_MAX_CONNECTIONS_PER_ADDRESS"]),
        keyed_reserve=most * int(values["HTTP_KEYED_RESERVE_PERCENT"]) // 100,
        uncapped=tuple(values.get("TRUSTED_PROXIES") or ()),
    )


def address_of(client: tuple[str, int] | None) -> str | None:
    """A client's address as the per-address cap counts it: IPv4 as is (also when mapped
    into IPv6), IPv6 by its /64, which one client usually holds whole. None when unknown
    (a Unix socket)."""
    if not client:
        return None
    host = str(client[0]).partition("%")[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _capped_address(client: tuple[str, int] | None, bounds: Bounds) -> str | None:
    """The address whose connections are counted, or None when they are not."""
    address = address_of(client)
    if address is None or not bounds.uncapped:
        return address
    try:
        ip = ipaddress.ip_address(address.partition("/")[0])
    except ValueError:
        return address
    return None if any(ip in network for network in bounds.uncapped) else address


def _is_keyed(url: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    if not url.startswith(b"/v1/"):
        return False
    for name, value in headers:
        if name in (b"authorization", b"x-api-key") and _KEYED.fullmatch(value):
            return True
    return False


class _RefusedError(Exception):
    """Stops the parser once a request is refused."""


def _response(status: bytes, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(text)).encode() + b"\r\nconnection: close\r\n\r\n" + text
    )


REQUEST_TIMEOUT = _response(b"408 Request Timeout", b"The request took too long to arrive.\n")
HEAD_TOO_LARGE = _response(
    b"431 Request Header Fields Too Large", b"The request's head is too large.\n"
)
STOPPING = _response(b"503 Service Unavailable", b"The server is stopping.\n")
TOO_MANY = _response(b"429 Too Many Requests", b"Too many connections from this address.\n")


def guarded_protocol(bounds: Bounds) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these bounds (it keeps
    the connection cap itself, whatever ``limit_concurrency`` says)."""
    open_by_address: dict[str, int] = {}  # this server's connections per client address
    over_cap = [0]  # connections open over their address's cap (see _mark_over)
    anonymous_limit = bounds.max_connections - bounds.keyed_reserve

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _in_head = False
        _in_body = False
        _head_bytes = 0  # received since the head was due, while it is not complete
        _head_parsed = 0  # the head's bytes as the parser hands them over
        _body_bytes = 0
        _body_since = 0.0
        _client_address: str | None = None  # the address counted, if capped
        _counted = False  # this connection counts against its address's cap now
        _over = False  # came in over the cap: only a keyed /v1 request may use it
        _refused = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limit_concurrency = None  # uvicorn's own check: on_headers_complete has ours
            self._client_address = None

        # --- the connection ------------------------------------------------------------

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if bounds.per_address:
                self._client_address = _capped_address(self.client, bounds)
                self._count_address()
            self._head_due()  # the first request's head is due from now

        def _count_address(self) -> None:
            """Count this connection against its address's cap, or mark it over the cap."""
            address = self._client_address
            if address is None or self._counted:
                return
            held = open_by_address.get(address, 0)
            if held >= bounds.per_address:
                self._mark_over(True)
                return
            open_by_address[address] = held + 1
            self._counted = True
            self._mark_over(False)

        def _mark_over(self, over: bool) -> None:
            if over != self._over:
                over_cap[0] += 1 if over else -1
                self._over = over

        def _release_address(self) -> None:
            if self._counted and self._client_address is not None:
                left = open_by_address[self._client_address] - 1
                if left:
                    open_by_address[self._client_address] = left
                else:
                    del open_by_address[self._client_address]
            self._counted = False

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            self._release_address()
            self._mark_over(False)
            super().connection_lost(exc)

        def handle_websocket_upgrade(self) -> None:
            # The WebSocket protocol takes the transport over; this one hears no more of it.
            self._stop_timer()
            self._release_address()
            super().handle_websocket_upgrade()

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _refuse(self, response: bytes) -> None:
            """Answer ``response`` (unless an answer has begun) and close."""
            self._stop_timer()
            self._refused = True
            self._in_head = self._in_body = False
            cycle = self.cycle
            started = cycle is not None and cycle.response_started
            if cycle is not None:  # the application, if running, hears of a disconnect
                cycle.disconnected = True
                cycle.message_event.set()
            if not self.transport.is_closing():
                if not started:
                    self.transport.write(response)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            # Uvicorn's, but a request refused here ends the parsing without a word more.
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                if not self.transport.is_closing():  # closing: refused here, said already
                    self.logger.warning("Invalid HTTP request received.")
                    self.send_400_response("Invalid HTTP request received.")
                return
            except httptools.HttpParserUpgrade:
                if self.transport.is_closing():
                    return
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self._in_head and self._head_bytes > bounds.max_header_bytes:
                self._refuse(HEAD_TOO_LARGE)  # a head not yet complete, already too large

        def shutdown(self) -> None:
            if self._in_body:  # a body still on its way is not waited for
                self._refuse(STOPPING)
            else:
                super().shutdown()

        # --- the head --------------------------------------------------------------------

        def _head_due(self) -> None:
            self._stop_timer()
            self._in_head = True
            self._head_bytes = self._head_parsed = 0
            self._timer = self.loop.call_later(bounds.header_timeout, self._expired)

        def _expired(self) -> None:
            """One timer a request, as cheap as uvicorn's head alone: due for the head,
            then (moved on if need be) for the body."""
            self._timer = None
            if self._in_head:
                self._refuse(TOO_MANY if self._over else REQUEST_TIMEOUT)
            elif self._in_body:
                self._body_check()

        def on_message_begin(self) -> None:
            if self._refused:
                raise _RefusedError
            super().on_message_begin()
            if not self._in_head:  # a kept-alive connection's next request: its head is due
                self._count_address()  # it counts again until its head shows a key
                self._head_due()

        def on_url(self, url: bytes) -> None:
            self._head_parsed += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_parsed += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            # The request line's method and version, and the blank line, count too.
            if self._head_parsed + len(self.parser.get_method()) + 13 > bounds.max_header_bytes:
                self._refuse(HEAD_TOO_LARGE)
                raise _RefusedError
            self._in_head = False
            keyed = _is_keyed(self.url, self.headers)
            if keyed:
                self._release_address()  # a keyed request is not capped by address
                self._mark_over(False)
            elif self._over:
                self._refuse(TOO_MANY)
                raise _RefusedError
            if self.parser.should_upgrade() and self._should_upgrade():
                self._stop_timer()
                super().on_headers_complete()  # a WebSocket: its protocol takes over
                return
            # Connections over their address's cap whose head is not in count for no one.
            tasks, connections = len(self.tasks), len(self.connections) - over_cap[0]
            if (tasks >= anonymous_limit or connections > anonymous_limit) and not (
                tasks < bounds.max_connections and keyed
            ):
                # Full: 503, as uvicorn's own cap answers it.
                self._stop_timer()
                self.app, app = service_unavailable, self.app
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
                return
            super().on_headers_complete()
            self._in_body = True
            self._body_bytes = 0
            self._body_since = self.loop.time()
            # The head's timer stays: it fires no later than the body is due (then the
            # body's check moves it on), unless the body's timeout is the shorter.
            if bounds.body_timeout < bounds.header_timeout:
                self._stop_timer()
                self._timer = self.loop.call_later(bounds.body_timeout, self._expired)

        # --- the body --------------------------------------------------------------------

        def on_body(self, body: bytes) -> None:
            if self._refused:
                raise _RefusedError
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                raise _RefusedError
            self._stop_timer()
            self._in_body = False
            super().on_message_complete()

        def _body_check(self) -> None:
            now = self.loop.time()
            if self.flow.read_paused:  # the server is not reading: its delay, not the client's
                self._body_since, self._body_bytes = now, 0
                self._timer = self.loop.call_later(bounds.body_timeout, self._expired)
                return
            earned = self._body_bytes / bounds.body_min_rate if bounds.body_min_rate else 0.0
            due = self._body_since + bounds.body_timeout + earned
            if now < due:
                self._timer = self.loop.call_later(due - now, self._expired)
            else:
                self._refuse(REQUEST_TIMEOUT)

    return GuardedHttpToolsProtocol
