"""A lean HTTP/1.1 client for the gateway's upstream requests (engines, agents' relays).

One ``asyncio.Protocol`` per connection with httptools' response parser (the one uvicorn
uses), to a TCP address or an engine's Unix socket (``http+unix://`` and the socket's
path, percent-encoded: :func:`unix_url`), and a pool of idle keep-alive connections per
(host, port, TLS name): the most
recently used first, at most ``MAX_IDLE_PER_KEY`` of them, each closed after
``IDLE_SECONDS`` unused or as soon as its peer closes it. A request goes out in one write.

The answer is read as it comes: ``read()`` for all of it, ``iter_chunks()`` for each part
as it arrives (chunked transfer decoded). Reading from the socket pauses while more than
``HIGH_WATER`` bytes wait unread. A connection goes back to the pool only once its answer
ended cleanly and both sides allow keep-alive; a response closed or cancelled before that
closes its connection, so the engine sees the hang-up and stops generating.

Every failure (refused, reset, closed mid-answer, unreadable, connect timeout) raises
:class:`UpstreamError`. A request that fails on a reused connection before any byte of
its answer came (the peer had closed it while idle) is sent once more on a new one. There
is no total timeout: streams may run for minutes.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Iterable
from types import TracebackType
from typing import cast
from urllib.parse import quote, unquote, urlsplit

import httptools

# Never sent as given: Host and Content-Length are this client's own, the rest belong to
# one connection.
from hostagent.asgi import HOP_BY_HOP
from hostagent.unixsock import connect_unix

CONNECT_TIMEOUT = 10.0
IDLE_SECONDS = 30.0
MAX_IDLE_PER_KEY = 256
HIGH_WATER = 1024 * 1024  # unread answer bytes past which the socket is not read

# Anything but printable ASCII (and '#', which would end the path) is percent-encoded.
_UNSAFE_TARGET = re.compile(r"[^\x21-\x22\x24-\x7e]")
_SAFE_TARGET = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "#")
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})

_Key = tuple[str, int, str | None]  # host, port, TLS name (None: plain TCP)
UNIX_SCHEME = "http+unix"


def unix_url(path: str) -> str:
    """The origin of an HTTP server on the Unix socket ``path`` (an absolute path)."""
    return f"{UNIX_SCHEME}://{quote(path, safe='')}"


class UpstreamError(Exception):
    """The upstream could not be reached, or its answer broke off or could not be read."""


class _StaleConnectionError(Exception):
    """A reused connection failed before any byte of the answer: send the request again."""


class _Origin:
    __slots__ = ("host", "host_header", "port", "tls")

    def __init__(self, origin: str) -> None:
        if origin.startswith(f"{UNIX_SCHEME}://"):
            # A Unix socket: its path is the host (a TCP host never starts with "/"), no port.
            path = unquote(origin[len(UNIX_SCHEME) + 3 :])
            if not path.startswith("/"):
                raise ValueError(f"not an absolute socket path: {origin!r}")
            self.tls = False
            self.host = path
            self.port = 0
            self.host_header = b"localhost"
            return
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {origin!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        netloc = parts.netloc.rpartition("@")[2]
        self.host_header = netloc.encode("ascii" if netloc.isascii() else "idna")


class Response:
    """An upstream answer: ``status``, ``raw_headers`` (as received) and ``content_length``
    once the headers are in; the body through ``read()`` or ``iter_chunks()``. ``close()``
    (or leaving ``async with``) before the answer ended closes its connection."""

    __slots__ = (
        "_buffered",
        "_chunked",
        "_chunks",
        "_connection",
        "_done",
        "_error",
        "_head",
        "_headers_in",
        "_loop",
        "_waiter",
        "content_length",
        "raw_headers",
        "received",
        "status",
    )

    def __init__(self, connection: _Connection, loop: asyncio.AbstractEventLoop, head: bool):
        self._connection: _Connection | None = connection
        self._loop = loop
        self._head = head
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.received = False  # any byte of the answer
        self._chunked = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False  # the answer ended cleanly
        self._error: Exception | None = None
        self._headers_in: asyncio.Future[None] = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection unless the answer already ended cleanly (then it is back
        in the pool, or closed, already)."""
        connection = self._connection
        if connection is not None:
            self._connection = None
            connection.response = None
            connection.close()
            if not self._done and self._error is None:
                self._error = UpstreamError("the response was closed before its end")

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while True:
            if self._chunks:
                parts += self._chunks
                self._taken()
            if self._error is not None:
                raise self._error
            if self._done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    def iter_chunks(self) -> _Chunks:
        """The body as it arrives (what has come since the last chunk, joined)."""
        return _Chunks(self)

    # -- for the connection and the pool ------------------------------------------------------

    async def _wait_headers(self) -> None:
        try:
            await self._headers_in
        except asyncio.CancelledError:
            self.close()
            raise

    async def _wait(self) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        except asyncio.CancelledError:
            self.close()
            raise

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _taken(self) -> None:
        self._chunks = []
        self._buffered = 0
        connection = self._connection
        if connection is not None and connection.paused:
            connection.resume()

    def _fail(self, error: Exception) -> None:
        if not self._headers_in.done():  # (cancelled when its request was)
            self._headers_in.set_exception(error)
        if not self._done and self._error is None:
            self._error = error
        self._wake()


class _Chunks:
    __slots__ = ("_response",)

    def __init__(self, response: Response) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        response = self._response
        while True:
            chunks = response._chunks
            if chunks:
                response._taken()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if response._error is not None:
                raise response._error
            if response._done:
                raise StopAsyncIteration
            await response._wait()


class _Connection(asyncio.Protocol):
    """One connection to an upstream, and the parser of the answers that come on it."""

    def __init__(self, pool: UpstreamPool, key: _Key) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle = False  # in the pool
        self.idle_since = 0.0
        self.reused = False
        self.paused = False
        self._keep_alive = False
        self._interim = False  # a 1xx answer is being parsed

    def send(self, data: bytes, loop: asyncio.AbstractEventLoop, head: bool) -> Response:
        response = Response(self, loop, head)
        self.response = response
        cast("asyncio.Transport", self.transport).write(data)
        return response

    def close(self) -> None:
        self.response = None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idle:
            self.pool._forget(self)
        response = self.response
        if response is None:
            return
        self.response = None
        response._connection = None
        if response.status == 0:  # no answer's headers yet
            if self.reused and not response.received:
                response._fail(_StaleConnectionError())
            else:
                response._fail(UpstreamError(_closed("before its answer", exc)))
        elif exc is None and response.content_length is None and not response._chunked:
            response._done = True  # an answer without a length ends when its connection does
            response._wake()
        else:
            response._fail(UpstreamError(_closed("in the middle of its answer", exc)))

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: an idle connection has nothing to say
            self.close()
            return
        response.received = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            failed = self.response
            self.close()
            if failed is not None:
                failed._connection = None
                failed._fail(UpstreamError(f"the upstream's answer could not be read: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost says what it meant for the answer

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        response = self.response
        if response is None or response.status != 0:
            raise UpstreamError("an answer nobody asked for")
        response.raw_headers = []
        response.content_length = None
        response._chunked = False

    def on_header(self, name: bytes, value: bytes) -> None:
        response = cast("Response", self.response)
        response.raw_headers.append((name, value))
        if len(name) == 14 and name.lower() == b"content-length":
            try:
                response.content_length = int(value)
            except ValueError:
                raise UpstreamError(f"a bad content-length: {value!r}") from None
        elif len(name) == 17 and name.lower() == b"transfer-encoding":
            response._chunked = b"chunked" in value.lower()

    def on_headers_complete(self) -> None:
        response = cast("Response", self.response)
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue and the like: the answer comes next
            return
        response.status = status
        self._keep_alive = self.parser.should_keep_alive()
        if not response._headers_in.done():  # (cancelled when its request was)
            response._headers_in.set_result(None)
        if response._head:  # no body follows, whatever the headers say; not kept
            self.response = None
            response._connection = None
            response._done = True
            self.close()

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is None:
            return
        response._chunks.append(body)
        response._buffered += len(body)
        if response._buffered > HIGH_WATER and not self.paused:
            self.paused = True
            cast("asyncio.Transport", self.transport).pause_reading()
        response._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        response = self.response
        if response is None:
            return
        self.response = None
        response._connection = None
        response._done = True
        response._wake()
        if self.paused:
            self.resume()
        if self._keep_alive:
            self.pool._release(self)
        else:
            self.close()


class UpstreamPool:
    """Requests to upstreams over pooled keep-alive connections."""

    def __init__(self) -> None:
        self._idle: dict[_Key, list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.TimerHandle | None = None
        self._default_tls: ssl.SSLContext | None = None
        self.closed = False

    async def request(
        self,
        method: str,
        url: str,
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> Response:
        """Send the request and return once the answer's headers are in. ``headers`` are
        sent as given, less the connection's own (``HOP_BY_HOP``); with an https URL,
        ``ssl_context`` and ``server_hostname`` (default: the URL's host) check the peer."""
        if self.closed:
            raise UpstreamError("the upstream client is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that made them
            self._idle = {}
            self._reaper = None
            self._loop = loop
        origin, target = self._split(url)
        tls: ssl.SSLContext | None = None
        name: str | None = None
        if origin.tls:
            tls = ssl_context or self._tls()
            name = server_hostname or origin.host
        key = (origin.host, origin.port, name)
        data = _encode(method, target, origin.host_header, headers, body)
        head = method == "HEAD"
        connection = self._take(key)
        if connection is not None:
            response = connection.send(data, loop, head)
            try:
                await response._wait_headers()
            except _StaleConnectionError:
                pass  # closed by its peer while idle: once more on a new connection
            else:
                return response
        connection = await self._connect(loop, key, tls)
        response = connection.send(data, loop, head)
        await response._wait_headers()
        return response

    async def close(self) -> None:
        """Close the idle connections; those in use close when their answers end."""
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.idle = False
                connection.close()

    def idle_count(self) -> int:
        return sum(len(connections) for connections in self._idle.values())

    # -- connections -----------------------------------------------------------------------------

    def _split(self, url: str) -> tuple[_Origin, str]:
        start = url.find("://") + 3
        slash = url.find("/", start)
        if slash < 0:
            origin_text, target = url, "/"
        else:
            origin_text, target = url[:slash], url[slash:]
        origin = self._origins.get(origin_text)
        if origin is None:
            origin = self._origins[origin_text] = _Origin(origin_text)
        if _UNSAFE_TARGET.search(target):
            target = quote(target, safe=_SAFE_TARGET)
        return origin, target

    def _tls(self) -> ssl.SSLContext:
        if self._default_tls is None:
            self._default_tls = ssl.create_default_context()
        return self._default_tls

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, key: _Key, tls: ssl.SSLContext | None
    ) -> _Connection:
        host, port, name = key
        where = f"the socket {host}" if port == 0 else f"{host}:{port}"
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                if port == 0:
                    connection = await self._connect_unix(loop, key, host)
                else:
                    _, connection = await loop.create_connection(
                        lambda: _Connection(self, key), host, port, ssl=tls, server_hostname=name
                    )
        except TimeoutError:
            raise UpstreamError(
                f"connecting to {where} took longer than {CONNECT_TIMEOUT:.0f} s"
            ) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {where}: {exc}") from exc
        return connection

    async def _connect_unix(
        self, loop: asyncio.AbstractEventLoop, key: _Key, path: str
    ) -> _Connection:
        """A connection to the socket ``path``, waiting while its accept queue is full
        (:mod:`hostagent.unixsock`), so a burst of new connections to an engine waits for
        it instead of failing."""
        sock = await connect_unix(path, CONNECT_TIMEOUT)
        try:
            _, connection = await loop.create_unix_connection(
                lambda: _Connection(self, key), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        return connection

    def _take(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            connection.idle = False
            transport = connection.transport
            if not connection.closed and transport is not None and not transport.is_closing():
                return connection
        return None

    def _release(self, connection: _Connection) -> None:
        loop = self._loop
        if self.closed or connection.closed or loop is None:
            connection.close()
            return
        idle = self._idle.get(connection.key)
        if idle is None:
            idle = self._idle[connection.key] = []
        if len(idle) >= MAX_IDLE_PER_KEY:
            connection.close()
            return
        connection.idle = True
        connection.reused = True
        connection.idle_since = loop.time()
        idle.append(connection)
        if self._reaper is None:
            self._reaper = loop.call_at(connection.idle_since + IDLE_SECONDS, self._reap)

    def _forget(self, connection: _Connection) -> None:
        connection.idle = False
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)

    def _reap(self) -> None:
        """Close the connections idle for IDLE_SECONDS; come back for the next oldest."""
        self._reaper = None
        loop = self._loop
        if loop is None or self.closed:
            return
        cutoff = loop.time() - IDLE_SECONDS
        oldest: float | None = None
        for idle in self._idle.values():
            # Oldest first: connections are put back at the end and taken from there.
            expired = 0
            while expired < len(idle) and idle[expired].idle_since <= cutoff:
                expired += 1
            for connection in idle[:expired]:
                connection.idle = False
                connection.close()
            del idle[:expired]
            if idle and (oldest is None or idle[0].idle_since < oldest):
                oldest = idle[0].idle_since
        if oldest is not None:
            self._reaper = loop.call_at(oldest + IDLE_SECONDS, self._reap)


def _encode(
    method: str, target: str, host: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """The request line, headers and body, for one write."""
    parts = [method.encode("ascii"), b" ", target.encode("ascii"), b" HTTP/1.1\r\nhost: ", host]
    for name, value in headers:
        if name.lower() in HOP_BY_HOP:
            continue
        if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
            raise ValueError(f"a line break in the header {name!r}")
        parts += (b"\r\n", name, b": ", value)
    if body or method not in _BODYLESS_METHODS:
        parts += (b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
    else:
        parts.append(b"\r\n\r\n")
    return b"".join(parts)


def _closed(when: str, exc: Exception | None) -> str:
    reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    return f"the upstream closed the connection {when}{reason}"
