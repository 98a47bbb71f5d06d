"""Which server serves a data dir: ``<data dir>/server.pid``, written by a start.

The server keeps the file open with an exclusive ``flock`` for as long as it runs, so a
reader knows from the lock, not from the pid alone, whether one still does: a file left
behind by a server that was killed is not locked, and a pid reused by another program
proves nothing. The file says what a person asks next: which process, and since when.
Plain Python, no Django: ``capyctl status`` reads it, and so could a script.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

SERVER_FILE = "server.pid"

_held: dict[Path, int] = {}  # the files this process holds, by path: their descriptors


@dataclass(frozen=True)
class Serving:
    """A server that holds a data dir now."""

    pid: int
    started_at: float  # seconds since the epoch
    mode: str
    url: str

    def since_text(self) -> str:
        """When it started, as a clock reading (with the date unless it is today)."""
        started = time.localtime(self.started_at)
        if time.strftime("%Y-%m-%d", started) == time.strftime("%Y-%m-%d"):
            return time.strftime("%H:%M:%S", started)
        return time.strftime("%Y-%m-%d %H:%M:%S", started)

    def as_dict(self) -> dict[str, object]:
        return {
            "running": True,
            "pid": self.pid,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started_at)),
            "mode": self.mode,
            "url": self.url,
        }


def claim(data_dir: Path, *, mode: str, url: str) -> bool:
    """Say, in ``data_dir``, that this process serves it from now on, until it exits.

    Returns False (and writes nothing) when another running server already holds it: that
    one's start is what the file should keep saying.
    """
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = data_dir / SERVER_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    record = {"pid": os.getpid(), "started_at": time.time(), "mode": mode, "url": url}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    _held[path] = fd
    atexit.register(release, data_dir)
    return True


def release(data_dir: Path) -> None:
    """This process no longer serves ``data_dir``: the file goes, then the lock."""
    path = data_dir / SERVER_FILE
    fd = _held.pop(path, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        path.unlink()
    os.close(fd)


def serving(data_dir: Path) -> Serving | None:
    """The server that serves ``data_dir`` now, or None when none does."""
    path = data_dir / SERVER_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # held: a server runs
        else:
            return None  # left behind by a server that ended without removing it
        try:
            record = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return Serving(
                pid=int(record["pid"]),
                started_at=float(record["started_at"]),
                mode=str(record.get("mode") or ""),
                url=str(record.get("url") or ""),
            )
        except (ValueError, KeyError, TypeError):
            # Locked, but not written yet (a start between its lock and its write).
            return Serving(pid=0, started_at=time.time(), mode="", url="")
    finally:
        os.close(fd)
