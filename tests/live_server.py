"""A real standalone CapyCTL of one's own: ``capyctl start standalone`` as a program, on a
fresh data dir, with simulated GPUs (``CAPYCTL_SIM_GPUS``) and simulated engines
(``python -m hostagent.sim``), on a free loopback port.

``bench/contention.py`` measures turns through it and :mod:`tests.live_replay` replays
traces through it. It imports no Django: the server and its commands run as programs, as a
user runs them, so a benchmark imports this module as it is.

    server = LiveServer(gpus="24GiB", settings={"CAPYCTL_MIN_READY_SECONDS": "0"})
    try:
        server.start(sim_engine("sim", {"CAPYCTL_SIM_WAKE_SECONDS": "0.5"}),
                     ["deployment", "add", "a", "--engine", "sim", "--source", "m-a"])
        server.commands(["deployment", "start", "a"])
        ...  # /v1 at server.url, with server.key
        server.snapshot().events
    finally:
        server.close()
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from hostagent.runtime import free_port

ROOT = Path(__file__).resolve().parent.parent
CAPYCTL = str(Path(sys.executable).with_name("capyctl"))
SIM_ENGINE = f"{sys.executable} -m hostagent.sim"

# Several capyctl commands in one process, each as `capyctl ARGV` runs it (setting a server
# up costs one program start-up, not one per command); then, when asked, what the server
# has recorded, read through its own models: the events after an id (with their data,
# which `capyctl events --json` leaves out) and each deployment's state.
_PROGRAM = """
import contextlib, io, json, os, sys
from capyctl.cli import run
from hostagent.datadir import PRIVATE_UMASK
os.umask(PRIVATE_UMASK)
asked = json.load(sys.stdin)
results = []
for argv in asked["commands"]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    results.append([code, out.getvalue(), err.getvalue()])
    if code != 0:
        break
found = None
if asked["after"] is not None and all(code == 0 for code, _out, _err in results):
    import django
    django.setup()
    from capyctl.deployments.models import Deployment
    from capyctl.events.models import Event
    events = [
        {"id": e.pk, "time": e.created_at.timestamp(), "kind": e.kind, "subject": e.subject,
         "message": e.message, "duration_ms": e.duration_ms, "data": e.data}
        for e in Event.objects.filter(pk__gt=asked["after"]).order_by("id")
    ]
    states = {d.name: [d.observed_state, d.parked_mode]
              for d in Deployment.objects.order_by("name")}
    found = {"events": events, "states": states}
json.dump({"results": results, "snapshot": found}, sys.__stdout__)
"""

# Observed states that pass by themselves: a snapshot taken in one is not the last word.
PASSING_STATES = frozenset({"downloading", "starting", "waking", "draining", "parking", "stopping"})


class LiveServerError(RuntimeError):
    """The server or one of its commands failed; the message says which, with its output."""


@dataclass(frozen=True)
class Snapshot:
    """What the server recorded: events after some id, oldest first (``time`` in seconds
    since the epoch), and each deployment's ``(observed state, parked mode)``."""

    events: list[dict[str, Any]]
    states: dict[str, tuple[str, str]]

    @property
    def last_event_id(self) -> int:
        return int(self.events[-1]["id"]) if self.events else 0

    @property
    def settled(self) -> bool:
        """No deployment is in a state that passes by itself."""
        return not any(state in PASSING_STATES for state, _mode in self.states.values())


def sim_engine(name: str, env: Mapping[str, str], kind: str = "vllm") -> list[str]:
    """The ``capyctl engine add`` command of a simulated engine with these knobs."""
    knobs = [x for key, value in env.items() for x in ("--env", f"{key}={value}")]
    return ["engine", "add", name, "--kind", kind, "--command", f"{SIM_ENGINE} {kind}", *knobs]


class LiveServer:
    """``capyctl start standalone`` on a data dir of its own (removed by :meth:`close`).

    ``settings`` are ``CAPYCTL_*`` variables for the server and its commands; none of the
    caller's own ``CAPYCTL_*`` variables leak in.
    """

    def __init__(
        self,
        *,
        gpus: str = "24GiB",
        settings: Mapping[str, str] | None = None,
        prefix: str = "capyctl-live-",
    ) -> None:
        self.data = Path(tempfile.mkdtemp(prefix=prefix))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
        self.env.update(
            {
                "CAPYCTL_DATA_DIR": str(self.data),
                "CAPYCTL_SIM_GPUS": gpus,
                "CAPYCTL_LOG_LEVEL": "WARNING",
                "DJANGO_SETTINGS_MODULE": "capyctl.settings",
                "PYTHONUNBUFFERED": "1",
                **(settings or {}),
            }
        )
        self.url = ""
        self.key = ""
        self.log_path = self.data / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- commands -----------------------------------------------------------------------

    def commands(self, *argvs: Sequence[str]) -> list[str]:
        """Run ``capyctl`` commands in order, in one process; their outputs. The first that
        fails raises, naming it (those after it are not run)."""
        return self._program(argvs, after=None)[0]

    def commands_then_snapshot(
        self, *argvs: Sequence[str], after: int = 0
    ) -> tuple[list[str], Snapshot]:
        """:meth:`commands`, then :meth:`snapshot`, in one process."""
        outputs, found = self._program(argvs, after=after)
        if found is None:
            raise LiveServerError("the commands gave no snapshot")
        return outputs, found

    def snapshot(self, after: int = 0) -> Snapshot:
        """The events after event ``after`` and every deployment's state, as recorded."""
        return self.commands_then_snapshot(after=after)[1]

    def settled(self, after: int = 0, timeout: float = 30) -> Snapshot:
        """A snapshot once no deployment is starting, waking, parking, draining or stopping
        (the last one taken, if that does not come within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.snapshot(after)
            if found.settled or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def _program(
        self, argvs: Sequence[Sequence[str]], *, after: int | None
    ) -> tuple[list[str], Snapshot | None]:
        asked = {"commands": [list(a) for a in argvs], "after": after}
        done = subprocess.run(
            [sys.executable, "-c", _PROGRAM], env=self.env, cwd=ROOT, input=json.dumps(asked),
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise LiveServerError(f"capyctl commands failed: {done.stderr.strip()}")
        answer = json.loads(done.stdout)
        results = answer["results"]
        for argv, (code, out, err) in zip(argvs, results, strict=False):
            if code != 0:
                raise LiveServerError(
                    f"capyctl {' '.join(argv)} failed ({code}): {(err or out).strip()}"
                )
        found = answer["snapshot"]
        snapshot = None
        if found is not None:
            states = {name: (state, mode) for name, (state, mode) in found["states"].items()}
            snapshot = Snapshot(found["events"], states)
        return [out for _code, out, _err in results], snapshot

    # -- the server ---------------------------------------------------------------------

    def start(self, *setup: Sequence[str], timeout: float = 60) -> None:
        """Start the server, wait until ``/healthz`` answers, then run the ``setup``
        commands (engines, deployments) and make an admin key for ``/v1`` (:attr:`key`),
        in one process (the server has made the database by then)."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [CAPYCTL, "start", "standalone", "--listen", f"127.0.0.1:{port}"],
            env=self.env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None:
                raise LiveServerError(
                    f"the server exited with {self.process.returncode}:\n{self.log()}"
                )
            if time.monotonic() >= deadline:
                raise LiveServerError(
                    f"the server did not answer /healthz in {timeout:g}s:\n{self.log()}"
                )
            time.sleep(0.05)
        outputs = self.commands(*setup, ["key", "create", "--user", "admin"])
        self.key = outputs[-1].strip().splitlines()[-1]

    def _healthy(self) -> bool:
        try:
            answer = httpx.get(f"{self.url}/healthz", timeout=1, trust_env=False)
        except httpx.TransportError:
            return False
        return answer.status_code == 200

    def log(self) -> str:
        """What the server printed (its log level is ``CAPYCTL_LOG_LEVEL``, WARNING unless
        ``settings`` say otherwise)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        """Stop the server (SIGTERM: it stops its engines) and remove its data dir."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
