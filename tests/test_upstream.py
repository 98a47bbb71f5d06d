"""The gateway's upstream HTTP/1.1 client against small real servers on 127.0.0.1, on both
event loops (uvloop is what the gateway runs on)."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from capyctl.gateway import upstream
from capyctl.gateway.upstream import UpstreamError, UpstreamPool
from hostagent.runtime import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    factory = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop

    def run_on_loop(coroutine: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(asyncio.wait_for(coroutine, 30))

    return run_on_loop


class Server:
    """An HTTP/1.1 server whose answers ``handler`` writes; it counts its connections and
    keeps the requests it read."""

    def __init__(self, handler: Handler, context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.context = context
        self.accepted = 0
        self.requests: list[tuple[bytes, list[tuple[bytes, bytes]], bytes]] = []
        self.hung_up = asyncio.Event()  # a client closed a connection
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        scheme = "https" if self.context else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request; False when the client closed the connection instead."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.hung_up.set()
            return False
        line, *lines = head[:-4].split(b"\r\n")
        headers = [(k.lower(), v) for k, _, v in (h.partition(b": ") for h in lines)]
        length = int(dict(headers).get(b"content-length", b"0"))
        self.requests.append((line, headers, await reader.readexactly(length)))
        return True


def answer(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def keep_answering(reader, writer, server: Server) -> None:
    while await server.read_request(reader):
        writer.write(answer(b"hello", b"X-Engine: sim", b"Content-Type: text/plain"))


async def wait_for(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "waited in vain"
        await asyncio.sleep(0.01)


def test_a_sized_answer_and_what_the_request_carried(run):
    async def scenario() -> None:
        async with Server(keep_answering) as server:
            pool = UpstreamPool()
            headers = [
                (b"content-type", b"application/json"),
                (b"x-trace", b"7"),
                (b"connection", b"upgrade"),  # the connection's own: never passed on
                (b"Host", b"elsewhere"),
                (b"Content-Length", b"999"),
                (b"te", b"trailers"),
            ]
            response = await pool.request(
                "POST", f"{server.url}/v1/chat%20x?q=1", headers, b'{"a": 1}'
            )
            assert response.status == 200
            assert response.content_length == 5
            assert (b"X-Engine", b"sim") in response.raw_headers  # as received
            assert await response.read() == b"hello"
            line, sent, body = server.requests[0]
            assert line == b"POST /v1/chat%20x?q=1 HTTP/1.1"
            assert body == b'{"a": 1}'
            assert sorted(sent) == [
                (b"content-length", b"8"),
                (b"content-type", b"application/json"),
                (b"host", f"127.0.0.1:{server.port}".encode()),
                (b"x-trace", b"7"),
            ]
            # A decoded path is sent percent-encoded; a GET with no body has no length.
            response = await pool.request("GET", f"{server.url}/v1/models/ä b#c")
            assert await response.read() == b"hello"
            line, sent, _ = server.requests[1]
            assert line == b"GET /v1/models/%C3%A4%20b%23c HTTP/1.1"
            assert b"content-length" not in dict(sent)
            await pool.close()

    run(scenario())


def test_one_write_per_request():
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(data)

    async def scenario() -> None:
        connection = upstream._Connection(UpstreamPool(), ("h", 1, None))
        connection.transport = Transport()  # type: ignore[assignment]
        data = upstream._encode("POST", "/v1/x", b"h:1", [(b"a", b"b")], b"{}")
        connection.send(data, asyncio.get_running_loop(), head=False)

    asyncio.run(scenario())
    assert written == [b"POST /v1/x HTTP/1.1\r\nhost: h:1\r\na: b\r\ncontent-length: 2\r\n\r\n{}"]
    with pytest.raises(ValueError, match="line break"):
        upstream._encode("GET", "/", b"h", [(b"a", b"b\r\nx: y")], b"")


def test_a_chunked_answer_comes_as_it_is_sent(run):
    async def scenario() -> None:
        go_on = asyncio.Event()

        async def chunked(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"6\r\ndata: \r\n")
            await go_on.wait()  # the first chunk must arrive before the second is sent
            writer.write(b"4\r\none\n\r\n3\r\ntwo\r\n0\r\n\r\n")
            await reader.read()

        async with Server(chunked) as server:
            pool = UpstreamPool()
            response = await pool.request("POST", f"{server.url}/v1/x", (), b"{}")
            assert response.content_length is None
            parts = []
            async for chunk in response.iter_chunks():
                parts.append(chunk)
                go_on.set()
            assert parts[0] == b"data: "
            assert b"".join(parts) == b"data: one\ntwo"
            assert pool.idle_count() == 1  # ended cleanly: kept
            await pool.close()

    run(scenario())


def test_connections_are_kept_and_reused(run):
    async def scenario() -> None:
        async with Server(keep_answering) as server:
            pool = UpstreamPool()
            for _ in range(3):
                response = await pool.request("GET", f"{server.url}/v1/models")
                assert await response.read() == b"hello"
            assert server.accepted == 1
            assert pool.idle_count() == 1
            # Two at once need two connections; both are kept afterwards.
            first, second = await asyncio.gather(
                *(pool.request("GET", f"{server.url}/v1/models") for _ in range(2))
            )
            assert [await first.read(), await second.read()] == [b"hello", b"hello"]
            assert server.accepted == 2
            assert pool.idle_count() == 2
            await pool.close()

    run(scenario())


def test_a_connection_is_not_kept_when_either_side_says_close(run):
    async def closing(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"bye", b"Connection: close"))
        await reader.read()

    async def until_eof(reader, writer, server: Server) -> None:
        await server.read_request(reader)  # no length: the body ends with the connection
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async def scenario() -> None:
        for handler, body in ((closing, b"bye"), (until_eof, b"all of it")):
            async with Server(handler) as server:
                pool = UpstreamPool()
                response = await pool.request("GET", f"{server.url}/")
                assert await response.read() == body
                assert pool.idle_count() == 0
                await pool.close()

    run(scenario())


def test_a_connection_closed_while_idle_is_replaced_without_a_failure(run):
    async def one_then_close(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"hello"))  # offers keep-alive, then closes anyway

    async def one_then_drop_the_next(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"hello"))
        await server.read_request(reader)  # the next request finds it closing: no answer

    async def scenario() -> None:
        async with Server(one_then_close) as server:
            pool = UpstreamPool()
            assert await (await pool.request("GET", f"{server.url}/")).read() == b"hello"
            await wait_for(lambda: pool.idle_count() == 0)  # noticed while idle
            assert await (await pool.request("GET", f"{server.url}/")).read() == b"hello"
            assert server.accepted == 2
            await pool.close()
        async with Server(one_then_drop_the_next) as server:
            pool = UpstreamPool()
            assert await (await pool.request("POST", f"{server.url}/", (), b"1")).read()
            assert pool.idle_count() == 1
            # Sent on the kept connection, which closes without a byte: sent again.
            assert await (await pool.request("POST", f"{server.url}/", (), b"2")).read()
            assert server.accepted == 2
            assert [body for _, _, body in server.requests] == [b"1", b"2", b"2"]
            await pool.close()

    run(scenario())


def test_no_retry_once_the_answer_began(run):
    async def half_an_answer_the_second_time(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"hello"))
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")

    async def scenario() -> None:
        async with Server(half_an_answer_the_second_time) as server:
            pool = UpstreamPool()
            await (await pool.request("GET", f"{server.url}/")).read()
            with pytest.raises(UpstreamError, match="closed the connection before its answer"):
                await pool.request("POST", f"{server.url}/", (), b"x")
            assert server.accepted == 1
            await pool.close()

    run(scenario())


def test_an_upstream_that_dies_mid_answer_is_an_error(run):
    async def sized(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")

    async def streamed(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")

    async def garbled(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        await reader.read()

    async def scenario() -> None:
        async with Server(sized) as server:
            pool = UpstreamPool()
            response = await pool.request("GET", f"{server.url}/")
            with pytest.raises(UpstreamError, match="in the middle of its answer"):
                await response.read()
        async with Server(streamed) as server:
            response = await pool.request("GET", f"{server.url}/")
            seen = []

            async def read_on() -> None:
                async for chunk in response.iter_chunks():
                    seen.append(chunk)

            with pytest.raises(UpstreamError, match="in the middle of its answer"):
                await read_on()
            assert seen == [b"first"]  # what came before the break is passed on
        async with Server(garbled) as server:
            response = await pool.request("GET", f"{server.url}/")
            with pytest.raises(UpstreamError, match="could not be read"):
                await response.read()
        assert pool.idle_count() == 0
        await pool.close()

    run(scenario())


def test_nothing_listening_is_an_error(run):
    async def scenario() -> None:
        pool = UpstreamPool()
        with pytest.raises(UpstreamError, match=r"cannot connect to 127\.0\.0\.1"):
            await pool.request("GET", f"http://127.0.0.1:{free_port()}/v1/models")
        await pool.close()

    run(scenario())


def test_a_cancelled_request_closes_its_connection(run):
    async def slow_stream(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await reader.read()  # until the client hangs up
        server.hung_up.set()

    async def no_answer(reader, writer, server: Server) -> None:
        await server.read_request(reader)
        await reader.read()
        server.hung_up.set()

    async def scenario() -> None:
        pool = UpstreamPool()
        async with Server(slow_stream) as server:
            response = await pool.request("GET", f"{server.url}/")

            async def consume() -> None:
                async with response:
                    async for _ in response.iter_chunks():
                        pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.1)
            task.cancel()
            await asyncio.wait_for(server.hung_up.wait(), 5)
            assert pool.idle_count() == 0
        async with Server(no_answer) as server:  # cancelled while waiting for the headers
            asking = asyncio.ensure_future(pool.request("GET", f"{server.url}/"))
            await asyncio.sleep(0.1)
            asking.cancel()
            await asyncio.wait_for(server.hung_up.wait(), 5)
            assert pool.idle_count() == 0
        # A response left before its end closes its connection too.
        async with Server(slow_stream) as server:
            response = await pool.request("GET", f"{server.url}/")
            response.close()
            await asyncio.wait_for(server.hung_up.wait(), 5)
            with pytest.raises(UpstreamError):
                await response.read()
        await pool.close()

    run(scenario())


def test_a_large_answer_is_read_with_flow_control(run):
    total = 20 * 1024 * 1024
    block = bytes(range(256)) * 256  # 64 KiB

    async def big(reader, writer, server: Server) -> None:
        while await server.read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
            for _ in range(total // len(block)):
                writer.write(block)
                await writer.drain()

    async def scenario() -> None:
        async with Server(big) as server:
            pool = UpstreamPool()
            response = await pool.request("GET", f"{server.url}/")
            # Not reading: past the high-water mark, the socket must stop being read.
            await wait_for(lambda: response._buffered > upstream.HIGH_WATER)
            await asyncio.sleep(0.3)
            assert response._buffered < upstream.HIGH_WATER + 1024 * 1024
            digest = hashlib.sha256()
            size = 0
            async for chunk in response.iter_chunks():
                assert len(chunk) <= upstream.HIGH_WATER + 1024 * 1024
                digest.update(chunk)
                size += len(chunk)
            assert size == total
            assert digest.digest() == hashlib.sha256(block * (total // len(block))).digest()
            # Whole, and on the same connection.
            whole = await (await pool.request("GET", f"{server.url}/")).read()
            assert len(whole) == total
            assert server.accepted == 1
            await pool.close()

    run(scenario())


def test_idle_connections_are_closed_after_a_while(run, monkeypatch):
    monkeypatch.setattr(upstream, "IDLE_SECONDS", 0.2)

    async def scenario() -> None:
        async with Server(keep_answering) as server:
            pool = UpstreamPool()
            await (await pool.request("GET", f"{server.url}/")).read()
            assert pool.idle_count() == 1
            await asyncio.wait_for(server.hung_up.wait(), 5)
            assert pool.idle_count() == 0
            await pool.close()

    run(scenario())


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_checks_the_name_asked_for(run, tmp_path):
    cert, key = _certificate(tmp_path, "gpu1.example")
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert)

    async def scenario() -> None:
        async with Server(keep_answering, served) as server:
            pool = UpstreamPool()
            for _ in range(2):
                response = await pool.request(
                    "GET",
                    f"{server.url}/relay/x/v1/models",
                    ssl_context=client,
                    server_hostname="gpu1.example",
                )
                assert await response.read() == b"hello"
            assert server.accepted == 1
            assert server.requests[0][0] == b"GET /relay/x/v1/models HTTP/1.1"
            with pytest.raises(UpstreamError, match="cannot connect"):
                await pool.request(
                    "GET", f"{server.url}/", ssl_context=client, server_hostname="gpu2.example"
                )
            await pool.close()

    run(scenario())
