"""Engine processes: launched in their own process group, logged with a size cap,
waited on, stopped with SIGTERM then SIGKILL, and always reaped."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hostagent.errors import EngineExitedError, EngineStuckError, StartTimeoutError
from hostagent.kinds.base import KEY_VARIABLES

logger = logging.getLogger("hostagent.process")

DEFAULT_LOG_MAX_BYTES = 8 * 1024 * 1024

# What an engine inherits from this process's environment; nothing else does (a database
# password or a token meant for the server stays here). CAPYCTL_SIM_ reaches the simulated
# engines' knobs. The kind's variables and the engine's own env are added on top. Variables
# engines read API keys from are never inherited (VLLM_API_KEY matches VLLM_, and would
# open the engine to the host's key): the kind sets the one its engine reads.
INHERITED_NAMES = frozenset({"PATH", "HOME", "LANG", "TMPDIR"})
INHERITED_PREFIXES = (
    "LC_", "CUDA_", "NVIDIA_", "HF_", "VLLM_", "SGLANG_", "LLAMA_", "CAPYCTL_SIM_",
)  # fmt: skip


def inherited_env() -> dict[str, str]:
    """The allowlisted part of this process's environment, for an engine."""
    return {
        name: value
        for name, value in os.environ.items()
        if (name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES))
        and name not in KEY_VARIABLES
    }


class CappedLog:
    """An instance's log file; past ``max_bytes`` it rolls over to ``path.1`` (copy, then
    truncate), so an instance's logs never take much more than twice the cap.

    The engine writes to the file itself (opened for append), not through a pipe to this
    process: an engine must outlive its agent (a restart re-adopts it), and a pipe whose
    reader died would end it on its next log line.
    """

    def __init__(self, path: Path, max_bytes: int = DEFAULT_LOG_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _roll_over(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size and size + incoming > self.max_bytes:
            rolled = self.path.with_name(self.path.name + ".1")
            shutil.copyfile(self.path, rolled)
            rolled.chmod(0o600)
            os.truncate(self.path, 0)  # the engine's O_APPEND writes go on from the start

    def write(self, data: bytes) -> None:
        with self._lock:
            self._roll_over(len(data))
            with os.fdopen(self.open_for_child(), "ab") as handle:
                handle.write(data)

    def enforce(self) -> None:
        """Roll over if the engine wrote past the cap (called every second or so)."""
        with self._lock:
            self._roll_over(0)

    def open_for_child(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def watch(self, alive: Callable[[], bool], every: float = 1.0) -> threading.Thread:
        """Keep the cap while ``alive()`` (a daemon thread)."""

        def run() -> None:
            while alive():
                time.sleep(every)
                self.enforce()

        thread = threading.Thread(target=run, name=f"log-{self.path.stem}", daemon=True)
        thread.start()
        return thread


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
    """One running engine program: our child (``popen``), or one re-adopted after a
    restart of this process (``adopted``), whose exit status can no longer be known."""

    popen: subprocess.Popen[bytes] | None
    log_path: Path
    adopted: psutil.Process | None = None
    # Secrets an engine may print (SGLang logs its arguments, the key from its config file
    # among them): its log tail, which reaches events and errors, never shows them.
    hidden: tuple[str, ...] = ()
    started_at: float = field(default_factory=time.monotonic)
    _watch: threading.Thread | None = None

    @property
    def pid(self) -> int:
        if self.popen is not None:
            return self.popen.pid
        assert self.adopted is not None  # noqa: S101 - one of the two is always set
        return int(self.adopted.pid)

    def exit_code(self) -> int | None:
        """``None`` while it runs; reaps it when it has ended (no zombies). An adopted
        process that ended reports -1 (its status went to its first parent)."""
        if self.popen is not None:
            return self.popen.poll()
        assert self.adopted is not None  # noqa: S101
        try:
            running = self.adopted.is_running() and self.adopted.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            running = False
        return None if running else -1

    def alive(self) -> bool:
        return self.exit_code() is None

    def wait(self, timeout: float | None) -> None:
        """Wait for the end; raises subprocess.TimeoutExpired after ``timeout``."""
        if self.popen is not None:
            self.popen.wait(timeout=timeout)
            return
        assert self.adopted is not None  # noqa: S101
        try:
            self.adopted.wait(timeout=timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0) from None
        except psutil.NoSuchProcess:
            return

    def log_tail(self, lines: int = 20) -> str:
        text = tail(self.log_path, lines)
        for secret in self.hidden:
            if secret:
                text = text.replace(secret, "[launch key]")
        return text


def adopt_process(
    pid: int, create_time: float, log_path: Path, log_max_bytes: int
) -> EngineProcess | None:
    """The engine ``pid`` started earlier (by a previous run of this agent), if it is still
    that same process (same start time); else None."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - create_time) > 0.01:
            return None  # the pid was reused by another program
        if process.status() == psutil.STATUS_ZOMBIE:
            return None  # it ended; its first parent has not been reaped yet
    except psutil.Error:
        return None
    engine = EngineProcess(popen=None, log_path=log_path, adopted=process)
    engine._watch = CappedLog(log_path, log_max_bytes).watch(engine.alive)
    return engine


def start_process(
    argv: list[str],
    *,
    env: dict[str, str],
    log_path: Path,
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
    cwd: Path | None = None,
) -> EngineProcess:
    """Start ``argv`` (never through a shell) in a new session and process group.

    The engine's environment is :func:`inherited_env` plus ``env``. Output and errors go
    to the capped log (0600: it may hold prompts and paths).
    """
    log = CappedLog(log_path, log_max_bytes)
    log.write(f"--- capyctl: starting {argv[0]} ---\n".encode())
    output = log.open_for_child()
    try:
        popen = subprocess.Popen(
            argv,
            env={**inherited_env(), **env},
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
    except OSError as exc:
        log.write(f"--- capyctl: could not start: {exc} ---\n".encode())
        raise EngineExitedError(f"could not start {argv[0]}: {exc.strerror}", None, "") from exc
    finally:
        os.close(output)
    engine = EngineProcess(popen=popen, log_path=log_path)
    engine._watch = log.watch(engine.alive)
    return engine


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


def _loopback(ip: str) -> bool:
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def exposed_listeners(pid: int, port: int) -> list[str]:
    """Where the engine ``pid`` listens beyond loopback: any TCP socket of the program
    itself (the one that serves HTTP), and ``port`` anywhere in its process tree (``port``
    0: it was launched on a Unix socket, and only the program's own sockets count).

    Its workers' own rendezvous sockets (torch.distributed stores, NCCL) are not counted:
    the engines bind those to every interface themselves, and they serve no HTTP.
    """
    try:
        leader = psutil.Process(pid)
        tree = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return []
    found: list[str] = []
    for process in tree:
        try:
            sockets = process.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for sock in sockets:
            if sock.status != psutil.CONN_LISTEN or not sock.laddr or _loopback(sock.laddr.ip):
                continue
            if process.pid == pid or (port and sock.laddr.port == port):
                ip = f"[{sock.laddr.ip}]" if ":" in sock.laddr.ip else sock.laddr.ip
                found.append(f"{ip}:{sock.laddr.port}")
    return sorted(set(found))


def socket_held(pid: int, path: Path) -> bool:
    """Whether the engine ``pid`` (or a process of its tree) listens on the Unix socket
    ``path``."""
    try:
        leader = psutil.Process(pid)
        tree = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return False
    wanted = str(path)
    for process in tree:
        try:
            sockets = process.net_connections(kind="unix")
        except psutil.Error:
            continue
        if any(str(sock.laddr) == wanted for sock in sockets):  # a Unix socket's: its path
            return True
    return False


# A process that outlives SIGKILL by this much is stuck in the kernel (a GPU driver call).
KILL_WAIT_SECONDS = 30.0


def stop_process(process: EngineProcess, *, grace_seconds: float = 10.0) -> int:
    """SIGTERM the process group, SIGKILL it after ``grace_seconds``; return the exit code."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if process.exit_code() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            logger.warning(
                "engine pid %s ignored SIGTERM for %.0fs: killing it", process.pid, grace_seconds
            )
            _signal_group(process.pid, signal.SIGKILL)
            try:
                process.wait(timeout=KILL_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                raise EngineStuckError(
                    f"engine pid {process.pid} did not end {KILL_WAIT_SECONDS:.0f}s after "
                    "SIGKILL (stuck in the kernel or the GPU driver?); its memory stays "
                    "counted"
                ) from None
    # Children that outlived the leader in its group go too, and are waited for: they may
    # hold the GPU memory (vLLM's engine core, tensor-parallel workers).
    _signal_group(process.pid, signal.SIGKILL)
    psutil.wait_procs(children, timeout=grace_seconds)
    code = process.popen.returncode if process.popen is not None else None
    return int(code) if code is not None else -1


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
