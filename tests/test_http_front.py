"""The HTTP front door, attacked as a client without credentials would: slow bodies and
held connections, bodies too large to keep, heads larger than they look, and pages on
other origins reaching for the dashboard's feed."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from capyctl.asgi import application
from tests.conftest import Server, run_program, start_server, stop_server

GIB = 1024**3
MIB = 1024**2


def _port(server: Server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _connect(port: int, source: str, timeout: float = 30) -> socket.socket:
    return socket.create_connection(
        ("127.0.0.1", port), timeout=timeout, source_address=(source, 0)
    )


def _answer(raw: socket.socket, within: float) -> bytes:
    """What the server says on ``raw`` within ``within`` seconds: its head and (given a
    ``content-length``) its body, or what came before it closed (b"" on a reset with
    nothing said)."""
    raw.settimeout(within)
    answer = b""
    try:
        while chunk := raw.recv(65536):
            answer += chunk
            head, found, body = answer.partition(b"\r\n\r\n")
            if found:
                length = re.search(rb"(?im)^content-length: *(\d+)", head)
                if length is None or len(body) >= int(length[1]):
                    break
    except (TimeoutError, ConnectionResetError):
        pass
    return answer


def _from(source: str) -> httpx.Client:
    """A client whose connections come from ``source`` (any 127.x address is this machine)."""
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(transport=transport, timeout=5)


# --- slow bodies and held connections ------------------------------------------------------


@dataclass
class SlowBody:
    """A POST whose head arrives at once and whose body trickles in a byte at a time."""

    raw: socket.socket
    opened: float
    answer: bytes = b""
    answered: float | None = None
    closed: bool = False
    said: list[bytes] = field(default_factory=list)


def _slow_bodies(port: int, source: str, count: int) -> list[SlowBody]:
    head = (
        b"POST /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100000\r\n\r\n"
    )
    opened = []
    for _ in range(count):
        raw = _connect(port, source)
        raw.setblocking(False)
        with contextlib.suppress(OSError):  # refused at once: seen as closed below
            raw.sendall(head)
        opened.append(SlowBody(raw, time.monotonic()))
    return opened


def _trickle(connections: list[SlowBody], stop: threading.Event) -> None:
    """A byte every half second on each connection; record what each is answered."""
    while not stop.is_set():
        for slow in connections:
            if slow.closed:
                continue
            try:
                chunk = slow.raw.recv(65536)
            except BlockingIOError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk is not None:
                slow.answer += chunk
                if slow.answered is None and chunk:
                    slow.answered = time.monotonic()
                if not chunk:
                    slow.closed = True
                    continue
            try:
                slow.raw.send(b"a")
            except BlockingIOError:
                pass
            except OSError:
                slow.closed = True
        stop.wait(0.5)


@pytest.mark.e2e
def test_slow_bodies_from_one_address_leave_room_for_everyone_else(program_env):
    """One address opens more slow-body connections than it may hold: the excess is
    refused at once, the rest get 408 when their body's deadline passes, and meanwhile
    another address is answered at once. When slow bodies from several addresses fill
    the share anonymous requests may use, a valid key is still answered."""
    program_env["CAPYCTL_HTTP_BODY_TIMEOUT"] = "6"
    program_env["CAPYCTL_HTTP_MAX_CONNECTIONS"] = "16"
    program_env["CAPYCTL_HTTP_MAX_CONNECTIONS_PER_ADDRESS"] = "6"
    program_env["CAPYCTL_HTTP_KEYED_RESERVE_PERCENT"] = "25"  # 4 of the 16 for keys
    server = start_server(program_env)
    made = run_program(program_env, "key", "create", "--user", "admin")
    assert made.code == 0, made.err
    key = made.out.strip().splitlines()[-1]
    port = _port(server)
    stop = threading.Event()
    attackers: list[SlowBody] = []
    feeder = threading.Thread(target=_trickle, args=(attackers, stop), daemon=True)
    try:
        # A client with a key may hold more connections than the cap from one address
        # (an app's pool, a burst of requests): keyed /v1 requests do not count against it.
        pool = [_connect(port, "127.0.0.4") for _ in range(12)]
        ask = (
            f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n"
        ).encode()
        for raw in pool:
            raw.sendall(ask)
        answers = [_answer(raw, 10) for raw in pool]
        for raw in pool:
            raw.close()
        assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers), answers
        attackers += _slow_bodies(port, "127.0.0.1", 10)
        feeder.start()
        # Beyond six from one address: refused at once (429, or closed before a word).
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            refused = [slow for slow in attackers if slow.closed or slow.answer]
            if len(refused) >= 4:
                break
            time.sleep(0.1)
        assert len(refused) == 4, [slow.answer for slow in attackers]
        assert all(slow.answer.startswith(b"HTTP/1.1 429") or not slow.answer
                   for slow in refused)  # fmt: skip

        def other(path: str) -> httpx.Response:  # a connection of its own each time
            headers = {"Authorization": f"Bearer {key}"} if path.startswith("/v1/") else {}
            with _from("127.0.0.2") as client:
                return client.get(f"{server.base_url}{path}", headers=headers)

        for _ in range(3):  # throughout the attack
            started = time.monotonic()
            assert other("/healthz").status_code == 200
            keyed = other("/v1/models")
            assert keyed.status_code == 200, keyed.text
            assert time.monotonic() - started < 2  # both, each well under a second
            time.sleep(0.3)

        # A second address fills what anonymous requests may hold (12 of 16): a page now
        # waits its turn, a valid key does not.
        second = _slow_bodies(port, "127.0.0.3", 6)
        attackers += second
        time.sleep(0.5)
        assert not any(slow.closed or slow.answer for slow in second)
        assert other("/healthz").status_code == 503
        started = time.monotonic()
        keyed = other("/v1/models")
        assert keyed.status_code == 200, keyed.text
        assert time.monotonic() - started < 1

        # Every slow body still open gets 408 once its deadline (6 s) has passed.
        deadline = time.monotonic() + 30
        held = [slow for slow in attackers if slow not in refused]
        while time.monotonic() < deadline and not all(slow.closed for slow in held):
            time.sleep(0.2)
        for slow in held:
            assert slow.answer.startswith(b"HTTP/1.1 408"), slow.answer
            assert slow.answered is not None
            assert slow.answered - slow.opened >= 5.5
        # And the slots are free again.
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200
    finally:
        stop.set()
        for slow in attackers:
            slow.raw.close()
        stop_server(server, 15)


# --- bodies too large to keep --------------------------------------------------------------


def _private_files(pid: int, folder: Path) -> list[str]:
    """The files under ``folder`` the process holds open (deleted ones too)."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


@pytest.fixture
def served(program_env, tmp_path) -> Iterator[tuple[Server, Path, str]]:
    """A standalone server with a temp dir of its own, and a staff session's cookies."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    program_env["TMPDIR"] = str(temp)
    program_env["CAPYCTL_ADMIN_PASSWORD"] = "admin-password-1"
    server = start_server(program_env)
    try:
        with httpx.Client(base_url=server.base_url) as browser:
            browser.get("/login/")
            form = {"username": "admin", "password": "admin-password-1",
                    "csrfmiddlewaretoken": browser.cookies["csrftoken"]}  # fmt: skip
            assert browser.post("/login/", data=form).status_code == 302
            cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
        yield server, temp, cookie
    finally:
        stop_server(server, 15)


ROUTES = [
    ("/api/keys/", b"application/json", b'"detail"'),
    ("/healthz", b"text/plain", None),
    ("/login/", b"text/plain", None),
    ("/admin/login/", b"text/plain", None),
    ("/keys/", b"text/plain", None),
]


@pytest.mark.e2e
def test_a_body_too_large_is_refused_before_it_is_read(served):
    """A 1 GiB ``Content-Length`` to five routes, anonymous and staff: 413 in the route's
    own shape within a second, and the temp dir gains nothing."""
    server, temp, cookie = served
    port = _port(server)
    free_before = os.statvfs(temp).f_bavail * os.statvfs(temp).f_frsize
    for path, content_type, shape in ROUTES:
        for cookies in ("", f"Cookie: {cookie}\r\n"):
            with _connect(port, "127.0.0.1") as raw:
                raw.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{cookies}"
                    f"Content-Type: application/json\r\nContent-Length: {GIB}\r\n\r\n".encode()
                )
                started = time.monotonic()
                answer = _answer(raw, within=1)
                assert time.monotonic() - started < 1
            assert answer.startswith(b"HTTP/1.1 413"), (path, cookies, answer)
            assert b"content-type: " + content_type in answer.lower(), answer
            if shape is not None:
                assert shape in answer
    # /v1 keeps its own limit (32 MiB), in its own error shape.
    with _connect(port, "127.0.0.1") as raw:
        raw.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {GIB}\r\n\r\n".encode()
        )
        answer = _answer(raw, within=1)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b'"code": "request_too_large"' in answer
    free_after = os.statvfs(temp).f_bavail * os.statvfs(temp).f_frsize
    assert abs(free_after - free_before) < 10 * MIB


@pytest.mark.e2e
def test_a_chunked_body_is_counted_as_it_arrives(served):
    """No ``Content-Length``: a chunked body is cut off once it passes the limit (1 MiB),
    anonymous or staff, and nothing of it is kept on disk."""
    server, temp, cookie = served
    port = _port(server)
    free_before = os.statvfs(temp).f_bavail * os.statvfs(temp).f_frsize
    chunk = b"%x\r\n%s\r\n" % (MIB, b"a" * MIB)
    for path, _, _ in ROUTES:
        for cookies in ("", f"Cookie: {cookie}\r\n"):
            with _connect(port, "127.0.0.1") as raw:
                raw.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{cookies}"
                    f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                )
                sent = 0
                raw.settimeout(5)
                try:
                    while sent < 64 * MIB:
                        raw.sendall(chunk)
                        sent += MIB
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    pass
                held = _private_files(server.process.pid, temp)
                answer = _answer(raw, within=5)
            # Cut off long before the 64 MiB were sent (socket buffers hold a few MiB).
            assert sent < 32 * MIB, (path, sent, answer)
            assert answer.startswith(b"HTTP/1.1 413") or answer == b"", answer
            assert held == [], held
    free_after = os.statvfs(temp).f_bavail * os.statvfs(temp).f_frsize
    assert abs(free_after - free_before) < 10 * MIB


# --- heads larger than they look ----------------------------------------------------------


@pytest.mark.e2e
def test_every_byte_of_a_head_counts(program_env):
    """A head over 64 KiB gets 431 whether it arrives in one write or in parts; one
    under it is served."""
    server = start_server(program_env)
    port = _port(server)

    def head(size: int) -> bytes:
        return b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"

    try:
        for parts in ([head(70 * 1024)], [head(97 * 1024)],
                      [head(70 * 1024)[:40_000], head(70 * 1024)[40_000:]]):  # fmt: skip
            with _connect(port, "127.0.0.1") as raw:
                for part in parts:
                    raw.sendall(part)
                    time.sleep(0.2)
                answer = _answer(raw, within=10)
            assert answer.startswith(b"HTTP/1.1 431"), [len(p) for p in parts]
        with _connect(port, "127.0.0.1") as raw:
            raw.sendall(head(60 * 1024))
            assert _answer(raw, within=10).startswith(b"HTTP/1.1 200")
    finally:
        stop_server(server, 15)


# --- the dashboard feed's origin -----------------------------------------------------------


def _staff_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


@pytest.mark.django_db(transaction=True)
async def test_the_dashboard_feed_takes_its_own_origin_only(alice, settings):
    """With a staff session, a page on the same host but another port, scheme or name
    (one the server also answers to) cannot open the feed; its own origin can, and so
    can a trusted origin."""
    settings.CSRF_TRUSTED_ORIGINS = ["https://capyctl.example.com"]
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "capyctl.example.com"]
    session = await database_sync_to_async(_staff_cookie)(alice)

    async def opens(origin: str) -> bool:
        headers = [(b"host", b"127.0.0.1:8000"), (b"origin", origin.encode()),
                   (b"cookie", f"sessionid={session}".encode())]  # fmt: skip
        feed = WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)
        connected, _ = await feed.connect()
        if connected:
            first = await feed.receive_json_from(timeout=5)
            assert first["type"] == "snapshot"
        await feed.disconnect()
        return bool(connected)

    assert await opens("http://127.0.0.1:8000")
    for foreign in ("http://127.0.0.1:1", "https://127.0.0.1:8000", "http://localhost:8000",
                    "http://127.0.0.1", "null", "https://capyctl.example.com:8443"):  # fmt: skip
        assert not await opens(foreign), foreign
    assert await opens("https://capyctl.example.com")


def test_address_keys_count_ipv6_by_64_and_mapped_ipv4_as_ipv4():
    from capyctl.cli.httpguard import address_of

    assert address_of(("2001:db8:1:2:aaaa::1", 5)) == address_of(("2001:db8:1:2:bbbb::9", 6))
    assert address_of(("2001:db8:1:3::1", 5)) != address_of(("2001:db8:1:2::1", 5))
    assert address_of(("::ffff:10.0.0.1", 5)) == "10.0.0.1"
    assert address_of(("::ffff:10.0.0.1", 5)) != address_of(("::ffff:10.0.0.2", 5))
    assert address_of(("fe80::1%eth0", 5)) == address_of(("fe80::2", 5))
    assert re.fullmatch(r"[\d.]+", address_of(("127.0.0.1", 1)) or "")
    assert address_of(None) is None


def test_a_trusted_proxy_has_no_per_address_cap():
    """Behind a proxy, every client arrives from its address: the cap would be the
    proxy's, so a trusted proxy has none (the proxy caps its clients)."""
    import ipaddress

    from capyctl.cli.httpguard import _capped_address, bounds_from_settings
    from capyctl.conf import env_networks

    values = {"HTTP_HEADER_TIMEOUT": 10, "HTTP_MAX_HEADER_BYTES": 65536,
              "HTTP_BODY_TIMEOUT": 10, "HTTP_BODY_MIN_RATE": 16384,
              "HTTP_MAX_CONNECTIONS": 4096, "HTTP_MAX_CONNECTIONS_PER_ADDRESS": 256,
              "HTTP_KEYED_RESERVE_PERCENT": 25,
              "TRUSTED_PROXIES": env_networks("X", {"X": "10.0.0.0/24,fd00::/8"})}  # fmt: skip
    bounds = bounds_from_settings(values)
    assert bounds.keyed_reserve == 1024
    assert _capped_address(("10.0.0.7", 1), bounds) is None
    assert _capped_address(("::ffff:10.0.0.7", 1), bounds) is None
    assert _capped_address(("fd00::5", 1), bounds) is None
    assert _capped_address(("10.0.1.7", 1), bounds) == "10.0.1.7"
    assert _capped_address(("2001:db8::1", 1), bounds) == str(ipaddress.ip_network("2001:db8::/64"))
