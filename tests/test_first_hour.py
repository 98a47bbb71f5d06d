"""A new user's first hour (issue 37): what `capyctl status` says of the server, a command
typed in another directory, a host's "last seen", /v1 answers at its edges, and the
server's log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from hostagent.routes import FORWARDED
from tests.conftest import (
    CAPYCTL,
    CliResult,
    Server,
    program_environment,
    run_program,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.e2e

SIM = f"{sys.executable} -m hostagent.sim vllm"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu"]

# llama-server's own answer to /v1/embeddings when it was started without --embeddings.
LLAMA_NO_EMBEDDINGS = {
    "error": {
        "code": 501,
        "message": "This server does not support embeddings. Start it with `--embeddings`",
        "type": "not_supported_error",
    }
}
# A llama-server built that way, as far as CapyCTL sees it: health, and that refusal.
FAKE_LLAMA = textwrap.dedent(
    f"""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    REFUSAL = json.dumps({LLAMA_NO_EMBEDDINGS!r}).encode()

    class Engine(BaseHTTPRequestHandler):
        def answer(self, status, body):
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(200, b'{{"status":"ok"}}')

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.answer(501, REFUSAL)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Engine).serve_forever()
    """
)


def elsewhere(cwd: Path, *argv: str) -> CliResult:
    """``capyctl ARGV`` typed in ``cwd``, with no data dir named anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    done = subprocess.run(
        [CAPYCTL, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    return CliResult(done.returncode, done.stdout, done.stderr)


def test_a_command_in_another_directory_makes_no_new_data_dir(tmp_path):
    """Alice's models "vanished": she typed `capyctl deployment list` in her home dir,
    and it made a new, empty .capyctl there with a new admin account."""
    listed = elsewhere(tmp_path, "deployment", "list")
    assert listed.code == 2
    assert listed.out == ""
    assert listed.err == (
        f"capyctl: error: no data dir here ({tmp_path / '.capyctl'} does not exist): run "
        "capyctl where the server's data dir is, name it with --data-dir DIR or "
        "CAPYCTL_DATA_DIR, or make a new one with `capyctl init`\n"
    )
    assert elsewhere(tmp_path, "status").code == 2
    assert list(tmp_path.iterdir()) == []  # nothing made

    made = elsewhere(tmp_path, "init")
    assert made.code == 0, made.err
    data = tmp_path / ".capyctl"
    lines = made.out.splitlines()
    assert lines[0] == f"made the data dir {data}"
    assert lines[1] == f"  database:  SQLite {data / 'capyctl.sqlite3'}"
    password = (data / "initial-admin-password").read_text().strip()
    password_file = data / "initial-admin-password"
    assert lines[2] == f"  log in as: admin / {password} (also in {password_file})"
    assert made.err == ""
    assert elsewhere(tmp_path, "deployment", "list").out == "no deployments\n"
    again = elsewhere(tmp_path, "init")
    assert again.code == 0
    made_already = f"the data dir {data} is made already (admin account 'admin'): nothing changed"
    assert again.out == made_already + "\n"


def test_a_data_dir_named_is_made_when_missing(tmp_path):
    """Naming one is choosing it: `--data-dir` (and CAPYCTL_DATA_DIR) work as before."""
    listed = elsewhere(tmp_path, "--data-dir", "mine", "deployment", "list")
    assert listed.code == 0, listed.err
    assert (tmp_path / "mine" / "initial-admin-password").exists()


# --- a running server --------------------------------------------------------------------


@dataclass
class Served:
    env: dict[str, str]
    server: Server
    key: str

    @property
    def key_id(self) -> str:
        return self.key.split("_")[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("first-hour")
    engine = tmp / "fake_llama.py"
    engine.write_text(FAKE_LLAMA)
    with program_environment(tmp / "data") as env:
        env["CAPYCTL_SIM_GPUS"] = "24GiB"
        run = lambda *argv: run_program(env, *argv)  # noqa: E731
        assert run("engine", "add", "sim", "--kind", "vllm", "--command", SIM).code == 0
        assert run("engine", "add", "llama", "--kind", "custom", "--command",
                   f"{sys.executable} {engine} {{host}} {{port}}",
                   "--options", '{"warm_up": false}').code == 0  # fmt: skip
        for name, engine_name in (("m", "sim"), ("emb", "llama")):
            added = run("deployment", "add", name, "--engine", engine_name, "--source",
                        f"{name}-src", "--gpu-memory", "4GiB")  # fmt: skip
            assert added.code == 0, added.err
        key = run("key", "create", "--user", "admin").out.strip()
        server = start_server(env)
        try:
            assert run("deployment", "start", "m").code == 0
            yield Served(env, server, key)
        finally:
            stop_server(server, signal.SIGTERM)


def status_json(env: dict[str, str]) -> dict[str, object]:
    done = run_program(env, "status", "--json")
    assert done.code == 0, done.err
    data: dict[str, object] = json.loads(done.out)
    return data


def test_status_says_which_server_serves_this_data_dir(served):
    """`capyctl status` said "online" whether or not a server ran."""
    shown = run_program(served.env, "status")
    assert shown.code == 0, shown.err
    pid = served.server.process.pid
    assert re.search(rf"^server: serving this data dir since \d\d:\d\d:\d\d \(pid {pid}\)$",
                     shown.out, re.MULTILINE), shown.out  # fmt: skip
    assert "\nhost local (online; " in shown.out
    data = status_json(served.env)
    server = data["server"]
    assert isinstance(server, dict)
    assert server["running"] is True
    assert server["pid"] == pid


def test_the_local_host_is_seen_while_the_server_runs(served):
    """The dashboard said "last seen 11:18:21" beside "live" three minutes later, and
    /api/hosts/ agreed: the standalone server never moved it."""

    def last_seen() -> datetime:
        hosts = status_json(served.env)["hosts"]
        assert isinstance(hosts, list)
        return datetime.fromisoformat(hosts[0]["last_seen_at"])

    first = last_seen()
    time.sleep(2.5)  # the loop beats every 2 s
    second = last_seen()
    assert second > first
    assert (datetime.now(second.tzinfo) - second).total_seconds() < 5


def test_the_dashboard_says_how_long_ago_the_host_was_seen(served):
    """The dashboard's host card said "last seen 11:18:21", a clock time that never moved,
    beside a green "live" badge."""
    password = (Path(served.env["CAPYCTL_DATA_DIR"]) / "initial-admin-password").read_text()
    base = served.server.base_url
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{base}/login/")
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", password.strip())
            page.click("button[type=submit]")
            expect(page).to_have_url(f"{base}/")
            seen = page.locator('[data-host="local"] .host-meta time')
            expect(seen).to_have_text(re.compile(r"^\d s ago$"))
            time.sleep(5)  # the server keeps seeing its host, and the page keeps up
            expect(seen).to_have_text(re.compile(r"^[0-4] s ago$"))
        finally:
            browser.close()


def test_wrong_methods_are_405_with_allow(served):
    """`GET /v1/chat/completions` (a browser, a curl without -d) said "not valid JSON"."""
    base = served.server.base_url
    auth = {"authorization": f"Bearer {served.key}"}
    for route in sorted(FORWARDED):
        answer = httpx.get(f"{base}{route}", headers=auth)
        assert answer.status_code == 405, (route, answer.text)
        assert answer.headers["allow"] == "POST"
        error = answer.json()["error"]
        assert error["code"] == "method_not_allowed"
        assert error["type"] == "invalid_request_error"
        assert error["message"] == f"`{route}` answers POST only, not GET."
    assert httpx.get(f"{base}/v1/chat/completions").status_code == 405  # before any key
    posted = httpx.post(f"{base}/v1/models", headers=auth, json={})
    assert posted.status_code == 405
    assert posted.headers["allow"] == "GET"
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200
    stored = httpx.put(f"{base}/v1/responses/resp_abc", headers=auth)
    assert (stored.status_code, stored.headers["allow"]) == (405, "GET, DELETE")


def test_an_engines_advice_says_how_to_follow_it_through_capyctl(served):
    """llama-server said "Start it with `--embeddings`"; the user had not started it."""
    started = run_program(served.env, "deployment", "start", "emb")
    assert started.code == 0, started.err
    answer = httpx.post(f"{served.server.base_url}/v1/embeddings", json={
        "model": "emb", "input": "hello"}, headers={"authorization": f"Bearer {served.key}"},
        timeout=30)  # fmt: skip
    assert answer.status_code == 501
    error = answer.json()["error"]
    assert error["type"] == "not_supported_error"
    assert error["message"] == (
        "This server does not support embeddings. Start it with `--embeddings`. CapyCTL "
        "starts this engine: give it --embeddings with `capyctl deployment update emb --args "
        '"... --embeddings"` (--args replaces its engine args: repeat the ones it has), then '
        "`capyctl deployment stop emb` and `capyctl deployment start emb`."
    )
    assert int(answer.headers["content-length"]) == len(answer.content)


def test_one_access_line_per_request_and_quiet_engine_polls(served):
    """The log had every engine health call and none of the client's requests."""
    base = served.server.base_url
    before = len(served.server.log().splitlines())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ok = httpx.post(f"{base}/v1/chat/completions", json=chat,
                    headers={"authorization": f"Bearer {served.key}"}, timeout=30)  # fmt: skip
    assert ok.status_code == 200
    refused = httpx.post(f"{base}/v1/chat/completions", json=chat,
                         headers={"authorization": "Bearer capy_nosuchkey0_x"})  # fmt: skip
    assert refused.status_code == 401
    time.sleep(2.5)  # engine polls happen meanwhile (every 2 s)
    log = served.server.log()
    new = log.splitlines()[before:]
    # (An earlier test's last line may land after `before`: a line is written once its
    # answer is sent.)
    access = [line for line in new if " capyctl.access: POST /v1/chat/completions " in line]
    assert len(access) == 2, new
    served_line = [line for line in access if " status=200 " in line]
    refused_line = [line for line in access if " status=401 " in line]
    assert len(served_line) == len(refused_line) == 1, access
    assert re.search(
        rf"INFO capyctl\.access: POST /v1/chat/completions model=m status=200 \d+\.\dms "
        rf"key={served.key_id}$", served_line[0]), access  # fmt: skip
    assert re.search(r"INFO capyctl\.access: POST /v1/chat/completions model=- status=401 "
                     r"\d+\.\dms key=-$", refused_line[0]), access  # fmt: skip
    assert served.key not in log
    assert served.key.rsplit("_", 1)[1] not in log  # never the secret
    assert not [line for line in log.splitlines() if " httpx: " in line]


def test_status_after_the_server_is_gone(tmp_path):
    """Stopped, or killed: `status` says no server runs, and the host's state is what was
    last known, not "online"."""
    with program_environment(tmp_path / "data") as env:
        env["CAPYCTL_SIM_GPUS"] = "24GiB"
        for sig in (signal.SIGTERM, signal.SIGKILL):
            server = start_server(env)
            stop_server(server, sig)
            shown = run_program(env, "status")
            assert shown.code == 0, shown.err
            assert "\nserver: not running (the hosts show their last known state)\n" in shown.out
            assert re.search(r"\nhost local \(state unknown, last seen \d{4}-\d\d-\d\d "
                             r"\d\d:\d\d:\d\d \(online\); ", shown.out), shown.out  # fmt: skip
            data = status_json(env)
            host = data["hosts"][0]  # type: ignore[index]
            assert (host["state"], host["last_known_state"]) == ("unknown", "online")
            assert data["server"] == {"running": False, "pid": None, "since": None,
                                      "mode": None, "url": ""}  # fmt: skip


# --- the parts, in this process --------------------------------------------------------


def test_nvml_missing_is_said_once(monkeypatch, caplog):
    """A start on a machine without NVML said "NVML is not available" twice: the probe is
    asked for at start and again by the scheduler."""
    import pynvml

    from hostagent import probe

    def refuse() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", refuse)  # the boundary: no GPU driver here
    monkeypatch.setattr(probe, "_said", set(), raising=False)
    with caplog.at_level("INFO", logger="hostagent.probe"):
        first = probe.make_probe(None)
        second = probe.make_probe(None)
    assert isinstance(first, probe.CpuOnlyProbe)
    assert isinstance(second, probe.CpuOnlyProbe)
    said = [r.getMessage() for r in caplog.records if r.name == "hostagent.probe"]
    assert said == [
        "NVML is not available (NVML Shared Library Not Found): treating this host as CPU-only"
    ]


def test_only_advice_to_start_with_a_flag_gets_the_hint():
    from capyctl.gateway.advice import with_capyctl_hint

    plain = json.dumps({"error": {"message": "`--temperature` must be at most 2"}}).encode()
    assert with_capyctl_hint(plain, "chat") == plain
    vllm = json.dumps({"object": "error", "message": "LoRA is not enabled. Restart the "
                       "server with --enable-lora to use adapters."}).encode()  # fmt: skip
    message = json.loads(with_capyctl_hint(vllm, "chat"))["message"]
    assert message.startswith(
        "LoRA is not enabled. Restart the server with --enable-lora to use adapters. CapyCTL "
        "starts this engine: give it --enable-lora with `capyctl deployment update chat --args"
    )
    text = b"start the server with --embeddings"
    assert with_capyctl_hint(text, "e").startswith(b"start the server with --embeddings. CapyCTL")
