"""`capyctl start standalone` as a new user runs it: serve, stop on a signal, keep data."""

import contextlib
import json
import signal
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from capyctl.cli.listening import parse_listen
from tests.conftest import run_program, start_server, stop_server

pytestmark = pytest.mark.e2e


def test_first_start_serves_health_and_admin_and_stops_on_sigterm(program_env):
    server = start_server(program_env)
    try:
        assert httpx.get(f"{server.base_url}/healthz").json() == {"status": "ok"}
        ready = httpx.get(f"{server.base_url}/readyz")
        assert ready.status_code == 200
        login = httpx.get(f"{server.base_url}/admin/login/")
        assert login.status_code == 200
        assert "CapyCTL" in login.text
        assert httpx.get(f"{server.base_url}/static/admin/css/base.css").status_code == 200
        assert "/static/capyctl/admin.css" in login.text
        assert httpx.get(f"{server.base_url}/static/capyctl/admin.css").status_code == 200
    finally:
        seconds = stop_server(server, signal.SIGTERM)
    assert seconds < 5, f"took {seconds:.1f}s to stop"
    assert server.process.returncode == 0
    log = server.log()
    assert "Finished server process" in log
    assert f"admin: {server.base_url}/admin/" in log
    assert f"dashboard: {server.base_url}/ " in log
    assert "log in as: admin / " in log
    password = log.split("log in as: admin / ")[1].split()[0]
    data_dir = program_env["CAPYCTL_DATA_DIR"]
    assert (Path(data_dir) / "initial-admin-password").read_text().strip() == password


def log_in_as_admin(browser: httpx.Client, password: str) -> httpx.Response:
    """Post the admin's login form as a browser would; 302 when the password is right."""
    page = browser.get("/admin/login/")
    token = browser.cookies["csrftoken"]
    assert 'name="csrfmiddlewaretoken"' in page.text
    return browser.post(
        "/admin/login/?next=/admin/",
        data={"username": "admin", "password": password, "csrfmiddlewaretoken": token},
        headers={"referer": f"{browser.base_url}admin/login/"},
    )


def test_the_admin_password_printed_at_first_start_logs_in(program_env):
    server = start_server(program_env)
    try:
        password = server.log().split("log in as: admin / ")[1].split()[0]
        with httpx.Client(base_url=server.base_url) as browser:
            done = log_in_as_admin(browser, password)
            assert done.status_code == 302
            assert done.headers["location"] == "/admin/"
            assert "Models, engines, hosts and keys" in browser.get("/admin/").text
    finally:
        stop_server(server, signal.SIGINT)


def test_capyctl_admin_password_is_the_first_admins_password(program_env):
    def logs_in(server, password: str) -> bool:
        with httpx.Client(base_url=server.base_url) as browser:
            return log_in_as_admin(browser, password).status_code == 302

    program_env["CAPYCTL_ADMIN_PASSWORD"] = "chosen-at-install-1"
    first = start_server(program_env)
    try:
        assert "log in as: admin (password from CAPYCTL_ADMIN_PASSWORD)\n" in first.log()
        assert "chosen-at-install-1" not in first.log()
        assert logs_in(first, "chosen-at-install-1")
    finally:
        stop_server(first, signal.SIGTERM)
    assert not (Path(program_env["CAPYCTL_DATA_DIR"]) / "initial-admin-password").exists()

    # Used only when the account is made: a later start with another value changes nothing.
    program_env["CAPYCTL_ADMIN_PASSWORD"] = "changed-later-2"
    second = start_server(program_env)
    try:
        assert "log in as: admin\n" in second.log()
        assert not logs_in(second, "changed-later-2")
        assert logs_in(second, "chosen-at-install-1")
    finally:
        stop_server(second, signal.SIGTERM)


def test_a_second_start_reuses_the_data(program_env):
    assert (
        run_program(program_env, "engine", "add", "v1", "--kind", "vllm", "--command", "vllm").code
        == 0
    )
    first = start_server(program_env)
    stop_server(first, signal.SIGTERM)
    key = run_program(program_env, "key", "create", "--user", "admin").out.strip()

    second = start_server(program_env)
    try:
        log = second.log()
        assert "log in as: admin (password in" in log
        assert "log in as: admin / " not in log  # not made again
    finally:
        stop_server(second, signal.SIGTERM)
    status = json.loads(run_program(program_env, "status", "--json").out)
    assert [e["name"] for e in status["engines"]] == ["v1"]
    assert key.startswith(status["keys"][0]["prefix"])


def test_daphne_serves_too(program_env):
    server = start_server(program_env, "--server", "daphne")
    try:
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200
        assert httpx.get(f"{server.base_url}/admin/login/").status_code == 200
    finally:
        seconds = stop_server(server, signal.SIGTERM)
    assert seconds < 5


def test_a_port_in_use_is_one_clear_line(program_env):
    server = start_server(program_env)
    try:
        port = server.base_url.rsplit(":", 1)[1]
        result = run_program(program_env, "start", "standalone", "--listen", f"127.0.0.1:{port}")
        assert result.code == 2
        assert (
            result.err.strip()
            == f"capyctl: error: cannot listen on 127.0.0.1:{port}: address already in use"
        )
    finally:
        stop_server(server, signal.SIGTERM)


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:http", "[::1"])
def test_a_bad_listen_address_is_refused(program_env, listen):
    result = run_program(program_env, "start", "standalone", "--listen", listen)
    assert result.code == 2
    assert result.err.count("\n") == 1
    assert f"invalid --listen {listen!r}" in result.err


def test_data_dir_flag_chooses_where_data_lives(program_env, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    result = run_program(
        program_env,
        "--data-dir",
        str(elsewhere),
        "engine",
        "add",
        "v1",
        "--kind",
        "vllm",
        "--command",
        "vllm",
    )
    assert result.code == 0, result.err
    assert (elsewhere / "secret_key").exists()
    listed = run_program(program_env, "--data-dir", str(elsewhere), "engine", "list", "--json")
    assert [e["name"] for e in json.loads(listed.out)] == ["v1"]
    default = run_program(program_env, "engine", "list", "--json")
    assert default.code == 0, default.err
    if "CAPYCTL_DATABASE_URL" not in program_env:
        # SQLite: the database is a file of the data dir, so the other dir has its own.
        assert (elsewhere / "capyctl.sqlite3").exists()
        assert json.loads(default.out) == []
    else:
        # PostgreSQL: CAPYCTL_DATABASE_URL names the database, whichever the data dir;
        # the data dir keeps only its files (no SQLite database appears in it).
        assert not (elsewhere / "capyctl.sqlite3").exists()
        assert [e["name"] for e in json.loads(default.out)] == ["v1"]


@pytest.mark.parametrize(
    ("listen", "where"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:8080", ("0.0.0.0", 8080)),  # noqa: S104 - what it parses to
        (":8080", ("0.0.0.0", 8080)),  # noqa: S104 - every interface
        ("8080", ("127.0.0.1", 8080)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::]:8080", ("::", 8080)),
    ],
)
def test_each_listen_form_names_its_address(listen, where):
    assert parse_listen(listen) == where


def _listening(pid: int, port: int) -> set[str]:
    """The addresses process ``pid`` listens on at ``port``."""
    return {
        c.laddr.ip
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_listening_on_every_interface_binds_there(program_env):
    """``--listen :PORT`` binds every interface (the other forms are parsed above); the
    banner shows a URL that works on this machine."""
    server = start_server(program_env, listen=":{port}")
    try:
        port = int(server.base_url.rsplit(":", 1)[1])
        assert _listening(server.process.pid, port) == {"0.0.0.0"}  # noqa: S104
        assert f"serving on http://127.0.0.1:{port}\n" in server.log()
    finally:
        stop_server(server, signal.SIGTERM)


def test_after_a_sigkill_the_next_start_ends_the_engines_left_behind(program_env):
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    sim = f"{sys.executable} -m hostagent.sim vllm"
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", sim).code == 0
    added = run(
        "deployment", "add", "a", "--engine", "sim", "--source", "a", "--gpu-memory", "8GiB"
    )
    assert added.code == 0, added.err

    def alive(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    first = start_server(program_env)
    engines: list[psutil.Process] = []
    try:
        started = run("deployment", "start", "a")
        assert started.code == 0, started.err
        engines = psutil.Process(first.process.pid).children(recursive=True)
        assert engines, "the engine is not the server's child"
    finally:
        first.process.kill()  # SIGKILL: no shutdown of its own
        first.process.wait()
    try:
        assert all(alive(p) for p in engines)  # left behind, still holding their GPU memory
        second = start_server(program_env)
        try:
            assert not any(alive(p) for p in engines)  # ended before it served
            assert run("events", "--model", "a", "--limit", "1").out.endswith(
                "a was ready when CapyCTL last stopped; its engine was ended and it starts "
                "again on its next request\n"
            )
        finally:
            stop_server(second, signal.SIGTERM)
    finally:
        for process in engines:
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_a_request_sent_as_soon_as_the_banner_shows_is_answered(program_env, tmp_path):
    """A newcomer copies the health URL from the banner and runs curl at once: the banner
    comes after the port is bound, so the request waits for the server, not refused."""
    import subprocess

    from hostagent.runtime import free_port
    from tests.conftest import CAPYCTL

    port = free_port()
    process = subprocess.Popen(
        [CAPYCTL, "start", "standalone", "--listen", f"127.0.0.1:{port}"],
        env=program_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("Stop with Ctrl-C."):
                break
        else:
            pytest.fail("the server ended before its banner")
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=60)
        assert health.json() == {"status": "ok"}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
