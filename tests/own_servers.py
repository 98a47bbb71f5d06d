"""Servers of a test's own, on spare ports, that a test may stop and start again: a Redis
and a PostgreSQL cluster. Drills of outages use these, never the machine's shared ones."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis


class OwnRedis:
    """A redis-server of a test's own, on a free port, that the test may stop and start
    again (as an outage does: it comes back empty, like the machine's, which keeps no
    data on disk), stop after saving its data (it comes back with it: :meth:`shutdown_save`)
    or hang (:meth:`hang`: it answers nothing for a while, as a paused server does)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        options = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        options += ["--appendonly", "no", "--dir", str(self.workdir)]
        options += ["--enable-debug-command", "local"]  # DEBUG SLEEP: a hung server
        self.process = subprocess.Popen(
            [binary, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)
            self.process = None

    def shutdown_save(self) -> None:
        """``SHUTDOWN SAVE``: its data written to its RDB file, which the next
        :meth:`start` loads (keys whose time ran out meanwhile are gone, as in Redis)."""
        assert self.process is not None
        client = redis.Redis.from_url(self.url)
        with contextlib.suppress(redis.ConnectionError):
            client.shutdown(save=True)
        self.process.wait(timeout=30)
        self.process = None

    def hang(self, seconds: float) -> threading.Thread:
        """``DEBUG SLEEP``: the server answers nothing for ``seconds`` (connections are
        accepted, calls time out, as with a paused or overloaded server); the thread that
        sent it ends when it is over."""
        client = redis.Redis.from_url(self.url, socket_timeout=seconds + 30)

        def sleep() -> None:
            with contextlib.suppress(redis.RedisError):  # it was stopped meanwhile
                client.execute_command("DEBUG", "SLEEP", seconds)

        thread = threading.Thread(target=sleep)
        thread.start()
        time.sleep(0.05)  # it is asleep
        return thread


class PausableProxy:
    """A TCP proxy to ``port`` on a free port of its own. :meth:`pause` stops forwarding
    in both directions without closing anything (a partition: calls time out), and
    :meth:`resume` forwards again what was held."""

    def __init__(self, port: int) -> None:
        self.target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._running = threading.Event()
        self._running.set()
        self._closed = False
        threading.Thread(target=self._accepting, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        self._closed = True
        self._running.set()
        self._listener.close()

    def _accepting(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._closed:
                self._running.wait()
                data = source.recv(65536)
                if not data:
                    break
                self._running.wait()  # what was read while it paused is held
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class OwnPostgres:
    """A PostgreSQL cluster made for the test (``initdb``; as the ``postgres`` user when the
    tests run as root, which PostgreSQL refuses to run as)."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}"
        self.workdir = workdir
        self.data = workdir / "data"
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        self.bin = Path(found[-1]).parent if found else Path(shutil.which("initdb") or "").parent
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if os.geteuid() == 0:
            shutil.chown(workdir, user="postgres")
        subprocess.run(
            [*self._as, str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U",
             "postgres", "--no-sync", "-E", "UTF8"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _ctl(self, *args: str) -> None:
        command = [*self._as, str(self.bin / "pg_ctl"), "-D", str(self.data), *args]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", options, "-l", str(self.workdir / "log"), "-w", "start")
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(f"{self.url}/postgres", connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        """As a crash or a restart looks to its clients: every connection cut at once."""
        self._ctl("-m", "immediate", "-w", "stop")


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    # Not under pytest's own temporary folder: the postgres user could not reach into it.
    workdir = Path(tempfile.mkdtemp(prefix="capyctl-pg-"))
    server = OwnPostgres(workdir)
    try:
        server.start()
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):  # stopped by the test
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class SmallDisk:
    """A tmpfs of ``size`` mounted on ``path`` in a mount namespace of its own (``unshare``
    as an unprivileged user: nothing on the machine is mounted or changed). Programs that
    should see it run through :meth:`inside`; the test fills it and frees it again, so the
    disk is really full (ENOSPC), as a full disk is."""

    def __init__(self, path: Path, size: str = "64m") -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        mount = f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$1"'
        script = f"{mount} && echo mounted && exec sleep infinity"
        self.holder = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
             "sh", "-c", script, "sh", str(path)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline().strip()
        assert line == "mounted", f"could not mount a tmpfs in a namespace of its own: {line!r}"

    def inside(self, *argv: str) -> list[str]:
        """``argv`` run where the small disk is mounted on ``path``."""
        return ["nsenter", "--target", str(self.holder.pid), "--user", "--mount", *argv]

    def fill(self) -> None:
        """Write a file until the disk is full."""
        filler = self.path / "filler"
        done = subprocess.run(self.inside("sh", "-c", f'cat /dev/zero > "{filler}"'),
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert "No space left on device" in done.stderr, done.stderr

    def free(self) -> None:
        subprocess.run(self.inside("rm", "-f", str(self.path / "filler")), check=True)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    disk = SmallDisk(tmp_path / "small-disk")
    try:
        yield disk
    finally:
        disk.close()
