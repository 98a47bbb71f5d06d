"""`capyctl start standalone` as a new user runs it: serve, stop on a signal, keep data."""

import json
import signal
from pathlib import Path

import httpx
import pytest

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


def test_the_admin_password_printed_at_first_start_logs_in(program_env):
    server = start_server(program_env)
    try:
        password = server.log().split("log in as: admin / ")[1].split()[0]
        with httpx.Client(base_url=server.base_url) as browser:
            page = browser.get("/admin/login/")
            token = browser.cookies["csrftoken"]
            assert 'name="csrfmiddlewaretoken"' in page.text
            done = browser.post(
                "/admin/login/?next=/admin/",
                data={"username": "admin", "password": password, "csrfmiddlewaretoken": token},
                headers={"referer": f"{server.base_url}/admin/login/"},
            )
            assert done.status_code == 302
            assert done.headers["location"] == "/admin/"
            assert "Models, engines, hosts and keys" in browser.get("/admin/").text
    finally:
        stop_server(server, signal.SIGINT)


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
