"""Shared fixtures: named people, the CLI in-process and as a program, a running server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.db import connection

from hostagent.runtime import free_port

CAPYCTL = str(Path(sys.executable).parent / "capyctl")


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings) -> None:
    """Password hashing is deliberately slow; tests need it correct, not slow."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def data_dir(tmp_path: Path, settings) -> Path:
    """A fresh data dir for code that writes files there (the admin password file)."""
    settings.DATA_DIR = tmp_path
    return tmp_path


@pytest.fixture
def alice(db) -> User:
    """Alice runs the installation: a staff user."""
    return User.objects.create_user("alice", password="alice-password-1", is_staff=True)


@pytest.fixture
def bob(db) -> User:
    """Bob builds apps against /v1: an ordinary user."""
    return User.objects.create_user("bob", password="bob-password-1")


@pytest.fixture
def cli(db, data_dir, capsys):
    """Run ``capyctl ARGS`` in this process against the test database."""
    from capyctl.cli import run

    def invoke(*argv: str) -> CliResult:
        try:
            code = run(list(argv))
        except SystemExit as exc:  # argparse exits for usage errors and --help
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return invoke


def table_counts() -> dict[str, int]:
    """Rows in every CapyCTL table, to prove a refused command changed nothing."""
    from django.apps import apps

    counts = {}
    for model in apps.get_models():
        if model._meta.app_label in {
            "hosts",
            "engines",
            "deployments",
            "ledger",
            "access",
            "events",
            "auth",
        }:
            counts[model._meta.label] = model._default_manager.count()
    return counts


# --- the program itself, in subprocesses -------------------------------------------------


@contextlib.contextmanager
def program_environment(data_dir: Path) -> Iterator[dict[str, str]]:
    """Environment for running ``capyctl`` as a program on ``data_dir`` and a fresh
    database: under a PostgreSQL test run (``CAPYCTL_DATABASE_URL`` set), a database of
    its own, dropped afterwards."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env["CAPYCTL_DATA_DIR"] = str(data_dir)
    env["PYTHONUNBUFFERED"] = "1"
    base_url = os.environ.get("CAPYCTL_DATABASE_URL", "")
    db_name = None
    if base_url.startswith("postgres"):
        db_name = f"capyctl_e2e_{uuid.uuid4().hex[:12]}"
        server, _, _ = base_url.rpartition("/")
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db_name}"')
        env["CAPYCTL_DATABASE_URL"] = f"{server}/{db_name}"
    try:
        yield env
    finally:
        if db_name is not None:
            server, _, _ = base_url.rpartition("/")
            with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


@pytest.fixture
def program_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for running ``capyctl`` as a program on a fresh data dir and database
    (one per test)."""
    with program_environment(tmp_path / "data") as env:
        yield env


def run_program(env: dict[str, str], *argv: str, stdin: str | None = None) -> CliResult:
    done = subprocess.run(
        [CAPYCTL, *argv],
        env=env,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


# Runs several capyctl commands in one process: each as ``capyctl ARGV`` would, on the same
# data dir and database, without paying the program's start-up once per command.
_BATCH = """
import contextlib, io, json, os, sys
from capyctl.cli import run
from hostagent.datadir import PRIVATE_UMASK
os.umask(PRIVATE_UMASK)
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    results.append([code, out.getvalue(), err.getvalue()])
json.dump(results, sys.__stdout__)
"""


def run_programs(env: dict[str, str], *commands: list[str]) -> list[CliResult]:
    """Run ``capyctl`` commands in order, in one process of their own (for setting up a
    test's state, where the process boundary is not what the test is about)."""
    done = subprocess.run(
        [sys.executable, "-c", _BATCH],
        env=env,
        capture_output=True,
        text=True,
        input=json.dumps([list(argv) for argv in commands]),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [CliResult(code, out, err) for code, out, err in json.loads(done.stdout)]


@dataclass
class Server:
    process: subprocess.Popen[str]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


def start_server(
    env: dict[str, str],
    *extra: str,
    timeout: float = 60,
    listen: str = "127.0.0.1:{port}",
    url: str = "http://127.0.0.1:{port}",
    wrapper: Sequence[str] = (),
) -> Server:
    """Start ``capyctl start standalone`` on a free port and wait until /healthz answers
    at ``url``. ``listen`` is what ``--listen`` gets; ``{port}`` in either is the port.
    ``wrapper`` runs the program (``nsenter …``: it sees a small disk of its own)."""
    port = free_port()
    log_path = Path(env["CAPYCTL_DATA_DIR"]).parent / f"server-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                *wrapper,
                CAPYCTL,
                "start",
                "standalone",
                "--listen",
                listen.format(port=port),
                *extra,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    server = Server(process, url.format(port=port), log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"server did not answer /healthz in {timeout}s:\n{server.log()}")


def stop_server(server: Server, sig: int) -> float:
    """Send ``sig`` and return how many seconds the process took to exit."""
    started = time.monotonic()
    server.process.send_signal(sig)
    try:
        server.process.wait(timeout=15)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    return time.monotonic() - started


def close_connection() -> None:
    connection.close()


@pytest.fixture
async def database_threads():
    """The loop's worker threads (where the gateway reads the database) and asgiref's,
    whose database connections are closed after the test, so its database can be
    dropped."""
    workers = 4
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=workers)
    loop.set_default_executor(pool)
    try:
        yield
    finally:
        everyone = threading.Barrier(workers)

        def close_on_each() -> None:
            everyone.wait(timeout=30)  # one call on each thread
            close_connection()

        await asyncio.gather(*(loop.run_in_executor(pool, close_on_each) for _ in range(workers)))
        pool.shutdown()
        await sync_to_async(close_connection)()  # and on asgiref's thread, the test's own


@pytest.fixture
def gpu24(tmp_path, settings):
    """A simulated 24 GiB GPU host whose engines run as children of this test process."""
    from capyctl.scheduler.drivers import set_local_driver
    from hostagent.simgpu import SimSpec
    from tests.scheduling import GIB, make_host

    driver = make_host(tmp_path, settings, SimSpec(unified=False, sizes=[24 * GIB]))
    yield driver
    driver.stop_all(grace_seconds=2)
    set_local_driver(None)
