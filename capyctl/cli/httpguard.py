"""Uvicorn's HTTP protocol with bounds on a request's head.

Uvicorn has no timeout for reading a request's head: a client that connects and sends
nothing, or sends its headers a byte at a time forever, holds a connection (and a place
under ``limit_concurrency``) for as long as it likes. Here the head of each request must
arrive within ``HTTP_HEADER_TIMEOUT`` seconds of the connection (or of the request's first
byte, on a kept-alive connection) and in at most ``HTTP_MAX_HEADER_BYTES``; otherwise the
connection is answered 408 or 431 and closed. Once the head is in, nothing changes: a long
answer (a stream) is not cut short.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def guarded_protocol(header_timeout: float, max_header_bytes: int) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these bounds."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_bytes = 0
                self._head_timer = self.loop.call_later(header_timeout, self._head_too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, status: bytes) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(
                    b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                )
                self.transport.close()

        def _head_too_slow(self) -> None:
            self._head_timer = None
            self._refuse(b"408 Request Timeout")

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()  # the first request's head is due from now

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a kept-alive connection's next request: its head is due

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None:  # still reading a head after these bytes
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse(b"431 Request Header Fields Too Large")

    return GuardedHttpToolsProtocol
