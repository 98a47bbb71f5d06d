"""CapyCTL installed as its users install it, outside the checkout: the wheels ``make dist``
builds (``release/build.py``), the full one with ``pipx`` and the host agent's slim one
with ``pip`` into a fresh venv. From them: standalone with the demo's models answers
``/v1`` and serves its pages with their styles, and a host agent without Django joins it
over mutual TLS and runs a model that ``/v1`` answers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hostagent.runtime import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SERVER_PACKAGES = {"django", "celery", "channels", "djangorestframework", "daphne", "psycopg"}


@dataclass
class Installed:
    capyctl: Path  # the full install's command (pipx)
    host_python: Path  # the slim install's venv
    host_capyctl: Path
    env: dict[str, str]
    home: Path  # an empty directory outside the checkout, where the user starts


def _run(
    argv: list[str | Path],
    env: dict[str, str],
    cwd: Path,
    timeout: float = 600,
    *,
    both: bool = False,
) -> str:
    """Run ``argv``; return its stdout (with ``both``: stdout and stderr as a terminal shows
    them, interleaved)."""
    done = subprocess.run(
        [str(a) for a in argv], env=env, cwd=cwd, stdout=subprocess.PIPE, text=True,
        stderr=subprocess.STDOUT if both else subprocess.PIPE, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("install")
    home = base / "home"
    home.mkdir()
    # What a user's shell has: no CAPYCTL_* settings, no checkout on the import path.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CAPYCTL_", "PYTHON", "VIRTUAL_ENV", "DJANGO_"))}  # fmt: skip
    env |= {"PIPX_HOME": str(base / "pipx"), "PIPX_BIN_DIR": str(base / "bin"),
            "PIPX_MAN_DIR": str(base / "man"), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    dist = base / "dist"
    _run([sys.executable, ROOT / "release" / "build.py", "--out", dist], env, ROOT)
    (wheel,) = dist.glob("capyctl-*.whl")
    (host_wheel,) = dist.glob("capyctl_host-*.whl")
    _run([sys.executable, "-m", "pipx", "install", "--python", sys.executable, wheel], env, home)
    venv = base / "host-venv"
    _run([sys.executable, "-m", "venv", venv], env, home)
    _run([venv / "bin" / "pip", "install", "-q", host_wheel], env, home)
    return Installed(base / "bin" / "capyctl", venv / "bin" / "python", venv / "bin" / "capyctl",
                     env, home)  # fmt: skip


@pytest.fixture(scope="module")
def demo(installed: Installed) -> Iterator[tuple[str, str, Path, int]]:
    """``capyctl start standalone --demo`` from the pipx install, in an empty directory,
    with its enrolment listener: (base URL, the demo's key, data dir, enrolment port)."""
    port, enrol = free_port(), free_port()
    log_path = installed.home / "server.log"
    env = installed.env | {"CAPYCTL_ENROL_ADDRESS": f"127.0.0.1:{enrol}"}
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [str(installed.capyctl), "start", "standalone", "--demo", "--listen",
             f"127.0.0.1:{port}", "--enrol-listen", f"127.0.0.1:{enrol}"],
            env=env, cwd=installed.home, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        key = None
        deadline = time.monotonic() + 90
        while key is None and time.monotonic() < deadline:
            assert server.poll() is None, log_path.read_text()
            found = re.search(r"key:\s+(capy_\S+)", log_path.read_text())
            key = found.group(1) if found else None
            time.sleep(0.2)
        assert key, log_path.read_text()
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{base}/readyz"), "the server ready", timeout=60)
        yield base, key, installed.home / ".capyctl-demo", enrol
    finally:
        _stop(server)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as systemd or Ctrl-C would; killed if it has not ended in 20 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _ask(base: str, key: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=60,
    )  # fmt: skip


def test_the_wheel_from_pipx_serves_the_demo_v1_and_the_pages_with_their_styles(
    installed: Installed, demo: tuple[str, str, Path, int]
) -> None:
    base, key, data_dir, _ = demo
    # Nothing came from the checkout: the program and its package live in pipx's venv.
    where = _run([installed.capyctl, "--version"], installed.env, installed.home)
    assert where.strip().startswith("capyctl ")
    answer = _ask(base, key, "sim-a")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    with httpx.Client(base_url=base, timeout=10) as browser:
        login = browser.get("/login/")
        assert login.status_code == 200
        styles = re.findall(r'href="(/static/[^"]+\.css)"', login.text)
        assert styles, login.text
        password = (data_dir / "initial-admin-password").read_text().strip()
        browser.post("/login/", data={"username": "admin", "password": password,
                                      "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
                     headers={"Referer": f"{base}/login/"})  # fmt: skip
        pages = {path: browser.get(path) for path in ("/", "/keys/", "/admin/", "/api/docs/")}
        for path, page in pages.items():
            assert page.status_code == 200, (path, page.status_code)
            styles += re.findall(r'href="(/static/[^"]+\.css)"', page.text)
        assert "sim-a" in pages["/"].text
        scripts = re.findall(
            r'src="(/static/[^"]+\.js)"', pages["/"].text + pages["/api/docs/"].text
        )
        assert any("capyctl/" in s for s in styles)
        assert any("admin/" in s for s in styles)
        assert any("swagger" in s for s in scripts), scripts
        for asset in {*styles, *scripts}:
            served = browser.get(asset)
            assert served.status_code == 200, asset
            assert served.content, asset


def test_make_venv_on_a_fresh_checkout_says_only_what_it_does(tmp_path: Path) -> None:
    """`make run`'s set-up, as after `git clone`: every line it prints is a command it ran,
    no build tool's notice box; the program it made runs."""
    checkout = tmp_path / "capyctl"
    tracked = _run(["git", "ls-files", "-z"], dict(os.environ), ROOT).split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes((ROOT / name).read_bytes())
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CAPYCTL_", "VIRTUAL_ENV", "MAKE"))}  # fmt: skip
    printed = _run(["make", "venv", f"PYTHON={sys.executable}"], env, checkout, both=True)
    lines = [line for line in printed.splitlines() if not line.startswith("WARNING: Location")]
    commands = ("/", ".venv/bin/", "PYTHONWARNINGS=ignore .venv/bin/", "touch ")
    assert all(line.startswith(commands) for line in lines), printed
    assert _run([checkout / ".venv" / "bin" / "capyctl", "--version"], env, checkout).startswith(
        "capyctl "
    )


def test_the_slim_host_install_has_no_server_packages_and_joins_over_mutual_tls(
    installed: Installed, demo: tuple[str, str, Path, int]
) -> None:
    base, key, data_dir, enrol = demo
    listed = _run([installed.host_python, "-m", "pip", "list", "--format", "json"],
                  installed.env, installed.home)  # fmt: skip
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed)}
    assert "capyctl-host" in names
    assert not SERVER_PACKAGES & names, SERVER_PACKAGES & names
    # The slim install says what it cannot do, in one line.
    refused = subprocess.run(
        [str(installed.host_capyctl), "status"], env=installed.env, cwd=installed.home,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("the other commands need the full install: "
                                           "pip install capyctl")  # fmt: skip

    def capyctl(*argv: str) -> str:
        env = installed.env | {"CAPYCTL_ENROL_ADDRESS": f"127.0.0.1:{enrol}"}
        return _run([installed.capyctl, "--data-dir", data_dir, *argv], env, installed.home)

    agent_port = free_port()
    added = capyctl("host", "add", "gpu1", "--address", f"127.0.0.1:{agent_port}")
    token = added.split("--join ")[1].split()[0]
    simulated = {
        "CAPYCTL_SIM_GPUS": "1x24GiB",
        "CAPYCTL_SIM_STATE_DIR": str(installed.home / "sim"),
    }
    agent_env = installed.env | simulated
    log_path = installed.home / "agent.log"
    with log_path.open("w") as log:
        agent = subprocess.Popen(
            [str(installed.host_capyctl), "start", "host", "--join", token, "--listen",
             f"127.0.0.1:{agent_port}", "--data-dir", str(installed.home / "agent")],
            env=agent_env, cwd=installed.home, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def online() -> bool:
            assert agent.poll() is None, log_path.read_text()
            hosts = json.loads(capyctl("host", "list", "--json"))
            return any(h["name"] == "gpu1" and h["state"] == "online" for h in hosts)

        wait_until(online, "gpu1 online", timeout=60, interval=0.5)
        capyctl("engine", "add", "remote-sim", "--kind", "vllm", "--command",
                f"{installed.host_python} -m hostagent.sim vllm")  # fmt: skip
        capyctl("deployment", "add", "r1", "--engine", "remote-sim", "--host", "gpu1",
                "--source", "m-r1", "--gpu-memory", "8GiB", "--gpus", "1",
                "--weights-size", "2GiB")  # fmt: skip
        answer = _ask(base, key, "r1")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "r1"
        # The engine ran under the slim agent: its log is in the agent's data dir.
        assert list((installed.home / "agent" / "logs").glob("*.log"))
    finally:
        _stop(agent)
