"""The web side as an outsider meets it: who may read the schema, the metrics and the
readiness details; which Host and Origin the server answers; failed logins; slow clients;
what the start banner shows."""

import logging
import socket
import time

import httpx
import pytest
from django.core.cache import cache
from django.test import Client, override_settings

from capyctl.access.services import issue_api_key
from capyctl.asgi import application

TOKEN = "metrics-token-0123456789"


def asgi(**headers: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=application)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver", headers=headers)


@pytest.mark.django_db
def test_the_api_schema_and_its_docs_are_for_staff_only(client, alice, bob):
    for path in ("/api/schema/", "/api/docs/"):
        assert client.get(path).status_code in (401, 403), path
    client.force_login(bob)
    for path in ("/api/schema/", "/api/docs/"):
        assert client.get(path).status_code == 403, path
    _, users_key = issue_api_key("alice", name="v1 only")
    _, admin_key = issue_api_key("alice", name="automation", admin=True)
    anonymous = Client()
    assert (
        anonymous.get("/api/schema/", HTTP_AUTHORIZATION=f"Bearer {users_key}").status_code == 403
    )
    assert (
        anonymous.get("/api/schema/", HTTP_AUTHORIZATION=f"Bearer {admin_key}").status_code == 200
    )
    client.force_login(alice)
    assert client.get("/api/schema/").status_code == 200
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.django_db(transaction=True)
async def test_metrics_need_the_token_or_a_staff_session(alice, bob):
    from asgiref.sync import sync_to_async

    def session_of(user):
        browser = Client()
        browser.force_login(user)
        return browser.cookies["sessionid"].value

    staff, other = await sync_to_async(session_of)(alice), await sync_to_async(session_of)(bob)
    with override_settings(METRICS_TOKEN=TOKEN):
        async with asgi() as web:
            refused = await web.get("/metrics")
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"].startswith("Bearer")
            assert "capyctl_" not in refused.text  # nothing was read, nothing is shown
            for header in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", TOKEN, f"Basic {TOKEN}"):
                assert (
                    await web.get("/metrics", headers={"Authorization": header})
                ).status_code == 401
            answer = await web.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert answer.status_code == 200
            assert "capyctl_deployment_state" in answer.text
            cookie = {"Cookie": f"sessionid={other}"}
            assert (await web.get("/metrics", headers=cookie)).status_code == 401
            cookie = {"Cookie": f"sessionid={staff}"}
            assert (await web.get("/metrics", headers=cookie)).status_code == 200
    with override_settings(METRICS_TOKEN=None):  # unset: no bearer token opens it
        async with asgi(Authorization="Bearer ") as web:
            assert (await web.get("/metrics")).status_code == 401


@pytest.mark.django_db
def test_readyz_says_failing_without_the_error_text(client, caplog):
    with (
        override_settings(REDIS_URL="redis://secret-user:hunter2@127.0.0.1:1/0"),
        caplog.at_level(logging.WARNING, logger="capyctl.web"),
    ):
        down = client.get("/readyz")
    assert down.status_code == 503
    assert down.json() == {
        "status": "unavailable",
        "checks": {"database": "ok", "broker": "failing"},
    }
    assert "Error" not in down.text
    assert "127.0.0.1" not in down.text
    assert "the broker fails: ConnectionError" in caplog.text  # the cause, for the operator


@pytest.mark.django_db
def test_failed_logins_are_throttled_per_user_and_address(client, bob, settings):
    settings.LOGIN_MAX_FAILURES = 3
    cache.clear()
    for _ in range(2):
        wrong = client.post("/login/", {"username": "bob", "password": "guess"})
        assert wrong.status_code == 200
        assert "Wrong user name or password" in wrong.text
    third = client.post("/login/", {"username": "bob", "password": "guess"})
    assert third.status_code == 429  # the try that reaches the limit says so
    locked = client.post("/login/", {"username": "bob", "password": "bob-password-1"})
    assert locked.status_code == 429  # even the right password, while locked out
    assert "Too many failed logins" in locked.text
    assert "_auth_user_id" not in client.session
    admin_login = client.post(
        "/admin/login/", {"username": "bob", "password": "bob-password-1", "next": "/admin/"}
    )
    assert "Too many failed logins" in admin_login.text
    # Another address, or another user name, is not locked out by these failures.
    elsewhere = Client(REMOTE_ADDR="10.9.9.9")
    assert (
        elsewhere.post("/login/", {"username": "bob", "password": "bob-password-1"}).status_code
        == 302
    )
    other = client.post("/login/", {"username": "alice", "password": "guess"})
    assert other.status_code == 200
    assert "Too many" not in other.text
    cache.clear()  # the lockout's time has passed
    assert (
        client.post("/login/", {"username": "bob", "password": "bob-password-1"}).status_code == 302
    )


def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; what comes back before the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(data)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer:
                break
        return answer


def _websocket(port: int, origin: str) -> bytes:
    head = (
        f"GET /ws/dashboard/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nOrigin: {origin}\r\n\r\n"
    )
    return _raw(port, head.encode()).split(b"\r\n", 1)[0]


def _held_for(port: int, bound: float) -> tuple[float, bytes]:
    """Send a request head a byte at a time, never finishing it; how long the server
    kept the connection, and what it said (giving up after ``bound`` seconds)."""
    started = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=bound) as raw:
        raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        raw.settimeout(0.25)
        while time.monotonic() - started < bound:
            try:
                raw.sendall(b"a")
                chunk = raw.recv(1024)
            except TimeoutError:
                continue
            except OSError:  # reset: closed
                break
            if not chunk:
                break
            answer += chunk
    return time.monotonic() - started, answer


@pytest.mark.e2e
def test_a_served_standalone_refuses_foreign_hosts_origins_and_slow_clients(program_env):
    from tests.conftest import start_server, stop_server

    program_env["CAPYCTL_HTTP_HEADER_TIMEOUT"] = "2"
    server = start_server(program_env)
    port = int(server.base_url.rsplit(":", 1)[1])
    try:
        # Host: the listen address and loopback names only (DNS rebinding gets 400).
        for name in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert httpx.get(f"{server.base_url}/login/", headers={"Host": name}).status_code == 200
        foreign = httpx.get(f"{server.base_url}/login/", headers={"Host": "evil.example"})
        assert foreign.status_code == 400
        # The dashboard's WebSocket: a page from another origin cannot open it.
        assert b" 403 " in _websocket(port, "http://evil.example")
        assert b" 101 " in _websocket(port, f"http://127.0.0.1:{port}")

        # A head sent a byte at a time, forever, is cut off (408) after its timeout; so
        # is a connection that says nothing. Generous bounds: the timeout is 2 s.
        held, said = _held_for(port, bound=60)
        assert held < 60, "the server kept a never-ending request head"
        assert said.startswith(b"HTTP/1.1 408")
        assert _raw(port, b"").startswith(b"HTTP/1.1 408")
        # A head larger than 64 KiB is refused without waiting for its end.
        huge = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000
        assert _raw(port, huge).startswith(b"HTTP/1.1 431")
        # Nothing of this slowed the others: a normal request is answered.
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200
    finally:
        stop_server(server, 15)


@pytest.mark.e2e
def test_allowed_hosts_and_trusted_origins_come_from_the_environment(program_env):
    """Behind a TLS proxy (docs/configuration.md): the server answers the names listed, and
    a form posted from the proxy's https origin is accepted; any other name or origin is
    refused."""
    from tests.conftest import start_server, stop_server

    program_env["CAPYCTL_ALLOWED_HOSTS"] = "capyctl.example.com,127.0.0.1"
    program_env["CAPYCTL_CSRF_TRUSTED_ORIGINS"] = "https://capyctl.example.com"
    program_env["CAPYCTL_ADMIN_PASSWORD"] = "admin-password-1"
    server = start_server(program_env)
    port = int(server.base_url.rsplit(":", 1)[1])

    def log_in(origin: str) -> httpx.Response:
        with httpx.Client(base_url=server.base_url,
                          headers={"Host": "capyctl.example.com"}) as browser:  # fmt: skip
            assert browser.get("/login/").status_code == 200
            form = {"username": "admin", "password": "admin-password-1",
                    "csrfmiddlewaretoken": browser.cookies["csrftoken"]}  # fmt: skip
            return browser.post("/login/", data=form, headers={"Origin": origin})

    try:
        for name, status in [
            ("capyctl.example.com", 200),
            (f"127.0.0.1:{port}", 200),
            (f"localhost:{port}", 400),  # a default name, left out of the list
            ("evil.example", 400),
        ]:
            answer = httpx.get(f"{server.base_url}/login/", headers={"Host": name})
            assert answer.status_code == status, name
        # The request comes in over plain HTTP, so the https origin is another origin: it
        # is accepted only because it is trusted.
        accepted = log_in("https://capyctl.example.com")
        assert accepted.status_code == 302, accepted.text
        refused = log_in("https://evil.example")
        assert refused.status_code == 403
        assert "CSRF verification failed" in refused.text
        # The dashboard's WebSocket takes pages from the names listed only.
        assert b" 101 " in _websocket(port, "https://capyctl.example.com")
        assert b" 403 " in _websocket(port, f"http://localhost:{port}")
    finally:
        stop_server(server, 15)


def test_printed_urls_hide_passwords():
    from capyctl.cli.start import mask_url

    assert mask_url("redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert (
        mask_url("postgres://capy:s%40cret@db:5432/capyctl")
        == "postgres://capy:***@db:5432/capyctl"
    )
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert "hunter2" not in mask_url("rediss://user:hunter2@[::1]:6380/1")


@pytest.mark.parametrize(
    ("env", "secure"),
    [({}, False), ({"CAPYCTL_BEHIND_TLS": "1"}, True), ({"CAPYCTL_SECURE_COOKIES": "yes"}, True)],
)
def test_cookies_are_secure_behind_tls(env, secure, tmp_path):
    import subprocess
    import sys

    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, "
        "getattr(s, 'SECURE_PROXY_SSL_HEADER', None), s.ALLOWED_HOSTS)"
    )
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("CAPYCTL_")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "DJANGO_SETTINGS_MODULE": "capyctl.settings",
             "CAPYCTL_DATA_DIR": str(tmp_path), **env},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = done.stdout.strip()
    assert line.startswith(f"{secure} {secure} ")
    assert ("HTTP_X_FORWARDED_PROTO" in line) == ("CAPYCTL_BEHIND_TLS" in env)
    assert "'*'" not in line  # no wildcard host by default
