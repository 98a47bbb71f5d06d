"""Engine processes: launched in their own process group, logged with a size cap,
waited on, stopped with SIGTERM then SIGKILL, and always reaped."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from hostagent.errors import EngineExitedError, StartTimeoutError

logger = logging.getLogger("hostagent.process")

DEFAULT_LOG_MAX_BYTES = 8 * 1024 * 1024


class CappedLog:
    """Copy a stream into ``path``; past ``max_bytes`` the file rolls over to ``path.1``,
    so an instance's logs never take more than twice the cap."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_LOG_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = path.open("ab")

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file.tell() + len(data) > self.max_bytes:
                self._file.close()
                self.path.replace(self.path.with_name(self.path.name + ".1"))
                self._file = self.path.open("ab")
            self._file.write(data)
            self._file.flush()

    def pump(self, stream: IO[bytes]) -> None:
        """Copy ``stream`` until it closes (run in a thread)."""
        try:
            for line in iter(stream.readline, b""):
                self.write(line)
        finally:
            stream.close()
            with self._lock:
                self._file.close()


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of an instance's log (both halves of a rolled log)."""
    chunks = []
    for candidate in (path.with_name(path.name + ".1"), path):
        try:
            chunks.append(candidate.read_bytes()[-65536:])
        except OSError:
            continue
    text = b"".join(chunks).decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class EngineProcess:
    """One running engine program."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    _pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        """``None`` while it runs; reaps it when it has ended (no zombies)."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.exit_code() is None

    def log_tail(self, lines: int = 20) -> str:
        return tail(self.log_path, lines)


def start_process(
    argv: list[str],
    *,
    env: dict[str, str],
    log_path: Path,
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
    cwd: Path | None = None,
) -> EngineProcess:
    """Start ``argv`` (never through a shell) in a new session and process group.

    ``env`` is added to this process's environment. Output and errors go to the capped log.
    """
    log = CappedLog(log_path, log_max_bytes)
    log.write(f"--- capyctl: starting {argv[0]} ---\n".encode())
    try:
        popen = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
    except OSError as exc:
        log.write(f"--- capyctl: could not start: {exc} ---\n".encode())
        raise EngineExitedError(f"could not start {argv[0]}: {exc.strerror}", None, "") from exc
    if popen.stdout is None:  # pragma: no cover - stdout=PIPE always gives one
        raise RuntimeError("the engine's output pipe is missing")
    pump = threading.Thread(target=log.pump, args=(popen.stdout,), daemon=True)
    pump.start()
    return EngineProcess(popen=popen, log_path=log_path, _pump=pump)


def wait_ready(
    process: EngineProcess,
    is_ready: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
) -> float:
    """Poll ``is_ready`` until true; return the seconds it took.

    Fails fast with :class:`EngineExitedError` when the process ends, and with
    :class:`StartTimeoutError` after ``timeout``; both carry the last log lines.
    """
    started = time.monotonic()
    deadline = started + timeout
    while True:
        code = process.exit_code()
        if code is not None:
            raise EngineExitedError(
                f"{what} exited with status {code} before it was ready", code, process.log_tail()
            )
        if is_ready():
            return time.monotonic() - started
        if time.monotonic() >= deadline:
            raise StartTimeoutError(
                f"{what} was not ready after {timeout:.0f}s", process.log_tail()
            )
        time.sleep(interval)


def stop_process(process: EngineProcess, *, grace_seconds: float = 10.0) -> int:
    """SIGTERM the process group, SIGKILL it after ``grace_seconds``; return the exit code."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if process.exit_code() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.popen.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            logger.warning(
                "engine pid %s ignored SIGTERM for %.0fs: killing it", process.pid, grace_seconds
            )
            _signal_group(process.pid, signal.SIGKILL)
            process.popen.wait()
    # Children that outlived the leader in its group go too, and are waited for: they may
    # hold the GPU memory (vLLM's engine core, tensor-parallel workers).
    _signal_group(process.pid, signal.SIGKILL)
    psutil.wait_procs(children, timeout=grace_seconds)
    if process._pump is not None:
        process._pump.join(timeout=5)
    code = process.popen.returncode
    return int(code) if code is not None else -1


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
