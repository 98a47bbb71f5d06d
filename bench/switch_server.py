"""bench/switch.py's server-mode side: one tree's CapyCTL as a user runs it on a server.

PostgreSQL (a database of the benchmark's own, created here and dropped after), Redis (an
empty database index, claimed with a key and emptied after), ``capyctl start server`` with
one Celery worker, and ``capyctl start host`` joined over mutual TLS with a simulated
24 GiB GPU. Two simulated vLLM models of 16 GiB on that host, parking and waking in 0 s.
Each round asks ``/v1`` from outside for the parked model while the other holds the GPU
and times the answer's first byte. The park's and the wake's events (``/api/events/``)
say when each ended and how long it took: the wake is counted from the end of the park
(a ``woke`` event's time, like ``x-capyctl-switch``'s, counts the park it waited for), and
the rest splits into the time before the park and after the wake. Then one more request,
to the model now ready, gives the cost of a request alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psycopg
import redis

from hostagent.runtime import free_port

POSTGRES = "postgres://postgres@127.0.0.1:5432"
REDIS = "redis://127.0.0.1:6379"
# Test runs take Redis databases counting down from 15 (tests/redis_db.py) and documents
# show 11; this benchmark takes the first empty one from 1 up, and marks it taken.
REDIS_DBS = range(1, 11)
CLAIM = "capyctl-bench:claim"
CAPYCTL = str(Path(sys.executable).parent / "capyctl")
SIM = f"{sys.executable} -m hostagent.sim vllm"
PAUSE_SECONDS = 0.3  # between a switch and the request to the model it made ready
# Before a switch, the model that holds the GPU has been idle this long: on a worker, a
# model counts as busy for 1.1 s after its last request (capyctl/scheduler/snapshots.py),
# and a switch asked sooner would wait for that, which is not what is measured here.
IDLE_SECONDS = 1.5
# A step of x-capyctl-switch: "parked a (ram) 34 ms", "woke b 106 ms".
STEP = re.compile(r"\b(parked|stopped|woke|started) \S+(?: \(\w+\))? (\d+) ms")


def claim_redis_db(run_id: str) -> int:
    for index in REDIS_DBS:
        client = redis.Redis.from_url(f"{REDIS}/{index}")
        if client.set(CLAIM, run_id, nx=True, ex=3600):
            if client.dbsize() == 1:
                return index
            client.delete(CLAIM)
    raise RuntimeError(f"no empty Redis database among {REDIS_DBS} to use")


class ServerSide:
    """One tree's server, worker and host agent, and the rounds asked of them."""

    def __init__(self, tree: Path, label: str) -> None:
        self.tree, self.label = tree, label
        self.run_id = f"{label}_{secrets.token_hex(4)}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"capyctl-switch-{label}-"))
        self.database = f"capyctl_benchswitch_{self.run_id}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.redis_db: int | None = None
        self.turn = 0

    # --- set up and take down ------------------------------------------------------------

    def __enter__(self) -> ServerSide:
        try:
            self._start()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _start(self) -> None:
        with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')
        self.redis_db = claim_redis_db(self.run_id)
        port, enrol_port, agent_port = free_port(), free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
        env.update(
            PYTHONPATH=str(self.tree),
            PYTHONUNBUFFERED="1",
            CAPYCTL_DATA_DIR=str(self.dir / "server"),
            CAPYCTL_DATABASE_URL=f"{POSTGRES}/{self.database}",
            CAPYCTL_REDIS_URL=f"{REDIS}/{self.redis_db}",
            CAPYCTL_MIN_READY_SECONDS="0",
            CAPYCTL_LOG_LEVEL="WARNING",
            CAPYCTL_ENROL_ADDRESS=f"127.0.0.1:{enrol_port}",
        )
        self.env = env
        added = self.capyctl("host", "add", "box", "--address", f"127.0.0.1:{agent_port}")
        token = added.split("--join ")[1].split()[0]
        self.capyctl("engine", "add", "sim", "--kind", "vllm", "--command", SIM,
                     "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=2GiB",
                     "--env", "CAPYCTL_SIM_SLEEP_SECONDS=0", "--env", "CAPYCTL_SIM_WAKE_SECONDS=0")  # fmt: skip
        for name in ("a", "b"):
            self.capyctl("deployment", "add", name, "--engine", "sim", "--host", "box",
                         "--source", f"m-{name}", "--gpu-memory", "16GiB", "--weights-size", "2GiB")  # fmt: skip
        self.key = self.capyctl("key", "create", "--user", "admin", "--admin").splitlines()[-1]
        self.base = f"http://127.0.0.1:{port}"
        self._spawn("server", env, "start", "server", "--listen", f"127.0.0.1:{port}",
                    "--enrol-listen", f"127.0.0.1:{enrol_port}", "--workers", "1")  # fmt: skip
        self._until(lambda: self._get("/healthz") == 200, "the server to answer")
        agent_env = {k: v for k, v in env.items()
                     if k not in ("CAPYCTL_DATA_DIR", "CAPYCTL_DATABASE_URL", "CAPYCTL_REDIS_URL")}  # fmt: skip
        agent_env.update(CAPYCTL_SIM_GPUS="24GiB", CAPYCTL_SIM_STATE_DIR=str(self.dir / "sim"))
        self._spawn("agent", agent_env, "start", "host", "--listen", f"127.0.0.1:{agent_port}",
                    "--data-dir", str(self.dir / "agent"), "--join", token)  # fmt: skip
        self._until(self._online, "the host agent to join and be online")
        self.client = httpx.Client(
            base_url=self.base, headers={"Authorization": f"Bearer {self.key}"}, timeout=120
        )
        for model in ("a", "b", "a"):  # both engines started; a holds the GPU, b is parked
            self._ask(model)
            time.sleep(IDLE_SECONDS)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(AttributeError):
            self.client.close()
        for process in reversed(self.processes):  # the agent first: it ends its engines
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.redis_db is not None:
            client = redis.Redis.from_url(f"{REDIS}/{self.redis_db}")
            if client.get(CLAIM) == self.run_id.encode():
                client.flushdb()  # ours since it was claimed empty
        with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        if kind is None:  # its logs are kept when it failed
            shutil.rmtree(self.dir, ignore_errors=True)

    def capyctl(self, *argv: str) -> str:
        done = subprocess.run([CAPYCTL, *argv], env=self.env, capture_output=True, text=True,
                              check=False, cwd=self.tree)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"capyctl {' '.join(argv[:2])}: {done.stderr.strip()}")
        return done.stdout.strip()

    def _spawn(self, name: str, env: dict[str, str], *argv: str) -> None:
        log = (self.dir / f"{name}.log").open("w")
        self.processes.append(
            subprocess.Popen(
                [CAPYCTL, *argv], env=env, cwd=self.tree, stdout=log, stderr=subprocess.STDOUT
            )
        )

    def _until(self, condition: Any, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[1:3]} ended; see {self.dir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"still waiting for {what}; see {self.dir}")
            time.sleep(0.2)

    def _get(self, path: str) -> int:
        try:
            return httpx.get(f"{self.base}{path}", timeout=2,
                             headers={"Authorization": f"Bearer {self.key}"}).status_code  # fmt: skip
        except httpx.TransportError:
            return 0

    def _online(self) -> bool:
        answer = httpx.get(f"{self.base}/api/hosts/box/", timeout=10,
                           headers={"Authorization": f"Bearer {self.key}"})  # fmt: skip
        return answer.status_code == 200 and answer.json().get("state") == "online"

    # --- a round -------------------------------------------------------------------------

    def _ask(self, model: str) -> tuple[float, str]:
        """Milliseconds to the first byte of a streamed answer; its x-capyctl-switch."""
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "stream": True}  # fmt: skip
        started = time.perf_counter()
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = response.iter_raw()
            first = next(chunks, b"")
            first_byte = time.perf_counter()
            rest = b"".join(chunks)
            if response.status_code != 200:
                raise RuntimeError(f"{model}: {response.status_code} {(first + rest)[:500]!r}")
        return (first_byte - started) * 1000, response.headers.get("x-capyctl-switch", "")

    def _events(self, since: float, subject: str) -> dict[str, tuple[float, float]]:
        """The park's and the wake's events since ``since`` (a wall-clock time): for each,
        when it ended and how long it took, in seconds."""
        answer = self.client.get("/api/events/", params={"kind": "deployment."})
        rows = answer.json()
        found: dict[str, tuple[float, float]] = {}
        for row in rows["results"] if isinstance(rows, dict) else rows:
            at = datetime.fromisoformat(row["time"]).timestamp()
            step = {"deployment.parked": "park", "deployment.woke": "wake"}.get(row["kind"])
            ours = (step == "wake") == (row["subject"] == subject)  # a victim's park, its wake
            if step and ours and at >= since and row["duration_ms"] is not None:
                found.setdefault(step, (at, row["duration_ms"] / 1000))
        return found

    def round(self) -> dict[str, Any]:
        target = "b" if self.turn % 2 == 0 else "a"  # the parked one
        self.turn += 1
        since = time.time()
        total, header = self._ask(target)
        if not header.startswith("parked "):
            raise RuntimeError(f"asking for {target} switched {header!r}, not a park and a wake")
        time.sleep(PAUSE_SECONDS)
        ready, _ = self._ask(target)
        events = self._events(since - 0.01, target)
        if set(events) != {"park", "wake"}:
            raise RuntimeError(f"no park and wake events for the switch to {target}: {events}")
        (park_end, park), (wake_end, wake_told) = events["park"], events["wake"]
        # A wake's own time: from the end of the park (a woke event's duration may count
        # the park it waited for) or its own start, whichever came later.
        wake = wake_end - max(park_end, wake_end - wake_told)
        time.sleep(IDLE_SECONDS)
        ms = 1000
        steps = {verb: float(value) for verb, value in STEP.findall(header)}
        return {
            "told_park": steps.get("parked", 0.0),
            "told_wake": steps.get("woke", 0.0),
            "total": total,
            "park": park * ms,
            "wake": wake * ms,
            "rest": total - (park + wake) * ms,
            "before": (park_end - park - since) * ms,
            "after": total - (wake_end - since) * ms,
            "ready": ready,
            "switch": header,
        }
