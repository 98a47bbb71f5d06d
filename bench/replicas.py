"""Replicas: throughput, prefix affinity, and scaling up from parked against from stopped.

CapyCTL standalone (``capyctl start standalone``, a data dir and working directory of its
own in a temporary folder, a free port) with four simulated GPUs of 24 GiB; every model is
a simulated vLLM engine of 16 GiB, so each replica has a GPU of its own. The load goes to
``/v1/chat/completions`` from httpx (async), and each answer's ``x-capyctl-replica``
names the replica that served it. A simulated engine runs 4 requests at once and queues
the rest (``CAPYCTL_SIM_MAX_CONCURRENCY``); it writes 200 tokens a second, and a request
asks for 10, so an answer takes 50 ms and one engine serves at most 80 a second.

1. Throughput: the same open load, Poisson arrivals at 1.2 times four engines' rate, on a
   model of 1, 2 and 4 replicas (``--replicas N``: all N kept up; each run starts once
   all N are ready and each has answered). Printed: answers a second (those finished
   within the load's span, over it), p50 and p99 latency, and the ratios of 2 and of 4
   replicas to 1. Every run is over its capacity, so its latency is mostly the time its
   outstanding requests wait in the engines' queues.
2. Affinity: a prompt-prefix-heavy trace (8 shared prefixes of 1,024 tokens, each
   request one of them chosen at random and a short suffix of its own, streamed) on 4
   replicas, routed with affinity (``--routing affinity``, the default) and by least load
   (``--routing least-load``). The engines keep a prefix cache of 2,048 tokens (two
   prefixes, a quarter of them; ``CAPYCTL_SIM_PREFIX_CACHE``) and prefill what it misses
   at 20,000 tokens a second, so a miss costs 51 ms before the first token. The hit rate
   is the engines' own count (their ``/metrics``, ``vllm:prefix_cache_hits`` over
   ``vllm:prefix_cache_queries``, in prompt tokens, read on each engine's socket before
   and after the trace); the answers carry no cached-token count. Time to first token:
   from the request's arrival to its first content chunk.
3. Scale-up: a model of one replica kept up and up to three by load (``--replicas 1:3``,
   ``--target-concurrency 4``, weights of 4 GiB declared with ``--weights-size``), under
   a step from a low load to 2.25 engines' worth. The time from the step until latency is
   back under a bound (the p90 of each half-second's arrivals at most 250 ms, none turned
   away, to the end of the run), first with the extra replicas stopped (never started:
   each start loads for ``CAPYCTL_SIM_LOAD_SECONDS``, 20 s), then with them parked (after
   the first step the load stops, and the model, idle, is parked whole,
   ``--idle-park-seconds``; a wake from host RAM takes ``CAPYCTL_SIM_WAKE_SECONDS``,
   1 s). Each run begins with one request alone, which wakes the first replica if it was
   parked, then the low load at once. One replica is brought up at a time, so two extra
   replicas take two starts or two wakes. Printed with each: the park mode of the extra
   replicas, and when each replica answered first.

``--quick``: shorter runs (2.5 s of load for each number of replicas, 240 requests of the
trace, a start of 4 s and a wake of 0.5 s), under two minutes, to check that it works;
the default takes about four.

The loads are open: arrivals at set times (a seeded Poisson process, the same in each run
it is compared across), each request's latency counted from its arrival time. At most so
many requests are outstanding at once (128 in parts 1 and 2, 96 in part 3); an arrival
that finds that many is turned away and counted, as k6's constant-arrival-rate executor
drops iterations, so the queues of an overloaded run stay bounded.

Every process started (the server, and through it the engines) ends with the run, on an
error or Ctrl-C too: the deployments are stopped, then the server, which runs in a
process group of its own, is terminated, and any engine still running with the run's data
dir on its command line is killed.

Run: .venv/bin/python bench/replicas.py [--quick] [--parts 1 2 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

# How deployments are told their replicas and their routing (capyctl deployment add).
FIXED_REPLICAS = ["--replicas", "{n}"]  # n replicas, all kept up
SCALED_REPLICAS = ["--replicas", "1:3"]  # one kept up, up to three by load
SCALED_MAX = 3
ROUTING = {"affinity": ["--routing", "affinity"], "least-load": ["--routing", "least-load"]}

GPUS = "4x24GiB"
MODEL_MEMORY = "16GiB"
# Part 3's weights, declared too: a copy in host RAM is otherwise taken to be as large as
# the GPU memory until a park has measured it, and the third of three replicas parked at
# once would not fit (it would park deep).
WEIGHTS = "4GiB"
SLOTS = 4  # requests an engine runs at once
TOKENS_PER_SECOND = 200
MAX_TOKENS = 10  # 50 ms an answer
ENGINE_RATE = SLOTS * TOKENS_PER_SECOND / MAX_TOKENS  # answers a second one engine serves

# Part 1
THROUGHPUT_REPLICAS = (1, 2, 4)
THROUGHPUT_RATE = 1.2 * 4 * ENGINE_RATE
THROUGHPUT_CAP = 128

# Part 2
PREFIXES = 8
PREFIX_TOKENS = 1024
PREFIX_CACHE_TOKENS = 2 * PREFIX_TOKENS
PREFILL_TOKENS_PER_SECOND = 20000
AFFINITY_RATE = 60.0
AFFINITY_CAP = 128

# Part 3
LOW_RATE = 0.25 * ENGINE_RATE
HIGH_RATE = 2.25 * ENGINE_RATE
STEP_CAP = 96
STEP_TARGET_CONCURRENCY = SLOTS
BOUND_SECONDS = 0.25
BIN_SECONDS = 0.5
BOUND_QUANTILE = 0.9

TARGETS = {"two": 1.8, "four": 3.4, "affinity": 3.0, "scale": 5.0}


@dataclass(frozen=True)
class Settings:
    throughput_seconds: float
    affinity_requests: int
    load_seconds: float
    wake_seconds: float
    idle_park_seconds: int
    low_seconds: float
    parked_high_seconds: float

    @property
    def stopped_high_seconds(self) -> float:
        # two starts one after the other, then room to settle
        return 2.5 * self.load_seconds + 5


QUICK = Settings(throughput_seconds=2.5, affinity_requests=240, load_seconds=4, wake_seconds=0.5,
                 idle_park_seconds=2, low_seconds=2, parked_high_seconds=6)  # fmt: skip
FULL = Settings(throughput_seconds=10, affinity_requests=1200, load_seconds=20, wake_seconds=1,
                idle_park_seconds=4, low_seconds=4, parked_high_seconds=15)  # fmt: skip


# --- CapyCTL standalone, and the processes it starts ----------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``capyctl start standalone`` on a data dir of its own, and the CLI beside it."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="capyctl-bench-replicas-"))
        self.data = self.folder / "data"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
        self.env.update({"CAPYCTL_DATA_DIR": str(self.data), "CAPYCTL_SIM_GPUS": GPUS,
                         "CAPYCTL_LOG_LEVEL": "WARNING"})  # fmt: skip
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.deployments: list[str] = []
        self.key = ""

    def capyctl(self, *argv: str, timeout: float = 300) -> str:
        done = subprocess.run([sys.executable, "-m", "capyctl", *argv], env=self.env,
                              cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"capyctl {' '.join(argv)}: {done.stderr.strip() or done.stdout}")
        return done.stdout.strip()

    def start(self) -> None:
        self.key = self.capyctl("key", "create", "--user", "admin")
        log = (self.folder / "server.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "capyctl", "start", "standalone", "--listen",
             f"127.0.0.1:{self.port}"],
            env=self.env, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server ended: {self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /healthz in 60 s: {self.log_tail()}")

    def log_tail(self) -> str:
        path = self.folder / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def engine(self, name: str, **knobs: float | str) -> None:
        env = [a for k, v in knobs.items() for a in ("--env", f"CAPYCTL_SIM_{k.upper()}={v}")]
        self.capyctl("engine", "add", name, "--kind", "vllm", "--command",
                     f"{sys.executable} -m hostagent.sim vllm", *env)  # fmt: skip

    def deployment(self, name: str, engine: str, *flags: str) -> None:
        self.capyctl("deployment", "add", name, "--engine", engine, "--source", name,
                     "--gpu-memory", MODEL_MEMORY, *flags)  # fmt: skip
        self.deployments.append(name)

    def replicas(self, name: str) -> list[dict[str, Any]]:
        """Each replica as ``deployment list --json`` shows it, the first one's first."""
        for row in json.loads(self.capyctl("deployment", "list", "--json")):
            if row["name"] == name:
                return list(row.get("replica_set") or [row])
        raise RuntimeError(f"no deployment {name}")

    def states(self, name: str) -> list[str]:
        """Each replica's observed state, the first one's first."""
        return [r["observed_state"] for r in self.replicas(name)]

    def wait_states(self, name: str, wanted: Any, timeout: float, what: str) -> list[str]:
        """Poll until ``wanted(states)``; RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.states(name)
            if wanted(states):
                return states
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: {what} not reached in {timeout:g} s ({states})")
            time.sleep(0.5)

    def stop(self, name: str) -> None:
        self.capyctl("deployment", "stop", name, timeout=120)
        self.wait_states(name, lambda s: all(x in ("stopped", "failed") for x in s), 60,
                         "all replicas stopped")  # fmt: skip

    def engines(self, served: str | None = None) -> list[tuple[int, str]]:
        """The simulated engines of this run (their data dir is on their command line),
        of the model ``served`` (all: None): each one's pid and socket."""
        found = []
        for process in psutil.process_iter(["pid", "cmdline"]):
            argv = process.info["cmdline"] or []
            if "hostagent.sim" not in argv or not any(str(self.data) in a for a in argv):
                continue
            if served is not None and _flag(argv, "--served-model-name") != served:
                continue
            found.append((process.info["pid"], _flag(argv, "--uds") or ""))
        return found

    def close(self) -> None:
        """Stop the deployments, then the server; kill any engine left over."""
        for name in self.deployments:
            with contextlib.suppress(Exception):
                self.capyctl("deployment", "stop", name, timeout=60)
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        for pid, _ in self.engines():
            try:
                os.killpg(pid, signal.SIGKILL)  # each engine leads a group of its own
            except ProcessLookupError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


# --- open loads -----------------------------------------------------------------------


@dataclass
class Answer:
    arrival: float  # seconds from the start of the run
    latency: float | None = None  # to the whole answer; None: turned away or failed
    first: float | None = None  # to the first content chunk (streamed requests)
    replica: str = ""
    status: int = 0  # 0: turned away (the cap); -1: no answer
    done: float = 0.0  # seconds from the start of the run
    tag: int = 0  # what the body was made from (a prefix's number)


@dataclass
class Run:
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0  # the arrivals' span

    @property
    def answered(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 200]

    @property
    def turned_away(self) -> int:
        return sum(1 for a in self.answers if a.status == 0)

    @property
    def failed(self) -> int:
        return sum(1 for a in self.answers if a.status not in (0, 200))


class Lanes:
    """``count`` clients of one connection each; a request takes a free one, and the
    callers keep at most ``count`` requests outstanding. (One client with a pool of many
    connections looks at each of them for each request: at a hundred connections, that
    took most of the client's time, and the client became the bottleneck.)"""

    def __init__(self, server: Server, count: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        headers = {"Authorization": f"Bearer {server.key}"}
        self.clients = [httpx.AsyncClient(base_url=server.base, limits=limits, timeout=120,
                                          headers=headers) for _ in range(count)]  # fmt: skip
        self.free = list(self.clients)

    async def __aenter__(self) -> Lanes:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for http in self.clients:
            await http.aclose()

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[httpx.AsyncClient]:
        http = self.free.pop()  # the last one given back: its connection is the warmest
        try:
            yield http
        finally:
            self.free.append(http)


def chat(model: str, text: str, *, stream: bool = False) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS}  # fmt: skip
    if stream:
        body["stream"] = True
    return body


async def ask(lanes: Lanes, body: dict[str, Any], answer: Answer, t0: float) -> None:
    arrival = t0 + answer.arrival
    try:
        async with (
            lanes.lane() as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            answer.replica = response.headers.get("x-capyctl-replica", "")
            if body.get("stream"):
                async for line in response.aiter_lines():
                    if answer.first is None and line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0].get("delta") or {}
                        if delta.get("content"):
                            answer.first = time.perf_counter() - arrival
            else:
                await response.aread()
            answer.status = response.status_code
    except Exception:  # no answer, or one cut off or unreadable
        answer.status = -1
        return
    now = time.perf_counter()
    answer.latency, answer.done = now - arrival, now - t0


async def open_load(
    lanes: Lanes,
    phases: list[tuple[float, float]],
    body: Any,
    cap: int,
    seed: int,
) -> Run:
    """Poisson arrivals, ``phases`` of (rate a second, seconds) one after the other;
    ``body(i)`` gives the i-th request's body and its tag. An arrival that finds ``cap``
    requests outstanding is turned away."""
    rng = random.Random(seed)
    run = Run()
    outstanding: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    start = 0.0
    index = 0
    for rate, seconds in phases:
        at = start
        while True:
            at += rng.expovariate(rate)
            if at >= start + seconds:
                break
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request, tag = body(index)
            answer = Answer(arrival=at, tag=tag)
            index += 1
            run.answers.append(answer)
            if len(outstanding) >= cap:
                continue
            task = asyncio.create_task(ask(lanes, request, answer, t0))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        start += seconds
    run.seconds = start
    if outstanding:
        await asyncio.wait(outstanding, timeout=120)
    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)] if ordered else math.nan


async def all_up(server: Server, lanes: Lanes, model: str, n: int) -> None:
    """Until all ``n`` replicas are ready and each has answered: bursts of requests (also
    what brings replicas up where load does), checking the states in between."""
    seen: set[str] = set()
    deadline = time.monotonic() + 180
    burst = 0
    while True:
        states = await asyncio.to_thread(server.states, model)
        if states.count("ready") >= n and len(seen) >= n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model}: {n} replicas not up in 180 s ({states}, "
                               f"answered from {sorted(seen)})")  # fmt: skip
        bodies = [
            chat(model, f"warm-up {burst} {i}: hello")
            for i in range(min(3 * SLOTS * n, len(lanes.clients)))
        ]
        burst += 1
        answers = [Answer(arrival=0.0) for _ in bodies]
        now = time.perf_counter()
        await asyncio.gather(*(ask(lanes, b, a, now) for b, a in zip(bodies, answers, strict=True)))
        bad = [a.status for a in answers if a.status != 200]
        if bad:
            raise RuntimeError(f"{model}: warm-up answers {Counter(bad)}")
        seen |= {a.replica for a in answers}
        await asyncio.sleep(0.3)


# --- 1. throughput --------------------------------------------------------------------


def throughput(server: Server, settings: Settings, seed: int) -> dict[int, float]:
    seconds = settings.throughput_seconds
    print(f"1. throughput: Poisson arrivals at {THROUGHPUT_RATE:.0f}/s "
          f"({THROUGHPUT_RATE / ENGINE_RATE:.1f} engines' worth; one engine serves "
          f"{ENGINE_RATE:.0f}/s: {SLOTS} at once, {MAX_TOKENS / TOKENS_PER_SECOND * 1000:.0f} ms "
          f"each) for {seconds:g} s, at most {THROUGHPUT_CAP} outstanding", flush=True)  # fmt: skip
    print(f"   {'replicas':>8}  {'answers/s':>9}  {'p50 ms':>7}  {'p99 ms':>7}  "
          f"{'turned away':>11}  {'failed':>6}  answers by replica", flush=True)  # fmt: skip
    server.engine(
        "plain",
        max_concurrency=SLOTS,
        tokens_per_second=TOKENS_PER_SECOND,
        completion_tokens=MAX_TOKENS,
    )
    rates: dict[int, float] = {}
    for n in THROUGHPUT_REPLICAS:
        name = f"throughput-{n}"
        flags = [f.format(n=n) for f in FIXED_REPLICAS]
        server.deployment(name, "plain", *flags)
        server.capyctl("deployment", "start", name)
        run = asyncio.run(_throughput_run(server, name, n, seconds, seed))
        server.stop(name)
        answered = run.answered
        in_window = sum(1 for a in answered if a.done <= run.seconds)
        rates[n] = in_window / run.seconds
        latencies = [a.latency * 1000 for a in answered if a.latency is not None]
        shares = Counter(a.replica for a in answered)
        by_replica = " ".join(f"{r or '(no header)'} {c / len(answered):.0%}"
                              for r, c in sorted(shares.items()))  # fmt: skip
        print(f"   {n:>8}  {rates[n]:>9.1f}  {pct(latencies, 0.5):>7.1f}  "
              f"{pct(latencies, 0.99):>7.1f}  {run.turned_away:>11}  {run.failed:>6}  "
              f"{by_replica}", flush=True)  # fmt: skip
    print(f"   2 vs 1 replicas: {rates[2] / rates[1]:.2f}x; 4 vs 1: {rates[4] / rates[1]:.2f}x",
          flush=True)  # fmt: skip
    return rates


async def _throughput_run(server: Server, name: str, n: int, seconds: float, seed: int) -> Run:
    async with Lanes(server, THROUGHPUT_CAP) as lanes:
        await all_up(server, lanes, name, n)

        def body(i: int) -> tuple[dict[str, Any], int]:
            return chat(name, f"request {i}: what do capybaras eat?"), 0

        return await open_load(lanes, [(THROUGHPUT_RATE, seconds)], body, THROUGHPUT_CAP, seed)


# --- 2. affinity ----------------------------------------------------------------------


@dataclass
class AffinityFigures:
    hit_rate: float
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    usual: float  # the share of each prefix's requests its most used replica served
    homes: Counter[str]  # prefixes by their most used replica
    answered: int
    failed: int


def prefix_text(i: int) -> str:
    words = [f"Shared context {i}:"] + [f"c{i}w{j}" for j in range(PREFIX_TOKENS - 3)]
    return " ".join(words)


def affinity(server: Server, settings: Settings, seed: int) -> dict[str, AffinityFigures]:
    count = settings.affinity_requests
    print(f"\n2. affinity: about {count} streamed requests, Poisson at {AFFINITY_RATE:.0f}/s, on 4 "
          f"replicas; each one of {PREFIXES} prefixes of {PREFIX_TOKENS} tokens (at random) "
          f"and a suffix of its own", flush=True)  # fmt: skip
    print(f"   engines: prefix cache {PREFIX_CACHE_TOKENS} tokens each, misses prefilled at "
          f"{PREFILL_TOKENS_PER_SECOND}/s ({PREFIX_TOKENS / PREFILL_TOKENS_PER_SECOND * 1000:.0f} "
          "ms for a prefix); hit rate: the engines' own counts, in prompt tokens",
          flush=True)  # fmt: skip
    print(f"   {'routing':<11}  {'hit rate':>8}  {'TTFT mean':>9}  {'p50':>6}  {'p99':>6}  "
          f"{'on its usual replica':>20}  {'failed':>6}", flush=True)  # fmt: skip
    server.engine("prefix", max_concurrency=SLOTS, tokens_per_second=TOKENS_PER_SECOND,
                  completion_tokens=MAX_TOKENS,
                  prefix_cache=PREFIX_CACHE_TOKENS,
                  prefill_tokens_per_second=PREFILL_TOKENS_PER_SECOND)  # fmt: skip
    figures: dict[str, AffinityFigures] = {}
    for routing, flags in ROUTING.items():
        name = f"prefix-{routing}"
        server.deployment(name, "prefix", *[f.format(n=4) for f in FIXED_REPLICAS], *flags)
        server.capyctl("deployment", "start", name)
        figures[routing] = asyncio.run(_affinity_run(server, name, count, seed))
        server.stop(name)
        f = figures[routing]
        print(f"   {routing:<11}  {f.hit_rate:>8.1%}  {f.ttft_mean:>6.1f} ms  {f.ttft_p50:>6.1f}  "
              f"{f.ttft_p99:>6.1f}  {f.usual:>20.0%}  {f.failed:>6}", flush=True)  # fmt: skip
    homes = figures["affinity"].homes
    print("   with affinity, the prefixes by the replica that served most of each: "
          + ", ".join(f"{r} {homes[r]}" for r in sorted(homes)), flush=True)  # fmt: skip
    ratio = figures["affinity"].hit_rate / max(figures["least-load"].hit_rate, 1e-9)
    print(f"   hit rate, affinity vs least-load: {ratio:.2f}x; mean TTFT "
          f"{figures['affinity'].ttft_mean:.1f} vs {figures['least-load'].ttft_mean:.1f} ms",
          flush=True)  # fmt: skip
    return figures


async def cache_counts(server: Server, model: str) -> tuple[float, float]:
    """The prefix cache's queries and hits, in prompt tokens, summed over the model's
    engines (each one's /metrics, on its socket)."""
    queries = hits = 0.0
    for _, path in server.engines(model):
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, timeout=10) as engine:
            text = (await engine.get("http://localhost/metrics")).text
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def _affinity_run(server: Server, name: str, count: int, seed: int) -> AffinityFigures:
    prefixes = [prefix_text(i) for i in range(PREFIXES)]
    rng = random.Random(seed + 1)
    chosen = [rng.randrange(PREFIXES) for _ in range(count)]
    async with Lanes(server, AFFINITY_CAP) as lanes:
        await all_up(server, lanes, name, 4)
        before = await cache_counts(server, name)

        def body(i: int) -> tuple[dict[str, Any], int]:
            text = f"{prefixes[chosen[i % count]]} Question {i}: what does it say?"
            return chat(name, text, stream=True), chosen[i % count]

        seconds = count / AFFINITY_RATE
        run = await open_load(lanes, [(AFFINITY_RATE, seconds)], body, AFFINITY_CAP, seed)
        after = await cache_counts(server, name)
    queries, hits = after[0] - before[0], after[1] - before[1]
    answered = run.answered
    firsts = [a.first * 1000 for a in answered if a.first is not None]
    served: dict[int, Counter[str]] = defaultdict(Counter)
    for a in answered:
        served[a.tag][a.replica] += 1
    usual = sum(max(c.values()) for c in served.values()) / max(len(answered), 1)
    homes = Counter({r: 0 for c in served.values() for r in c})
    homes.update(max(c, key=lambda r: c[r]) for c in served.values())
    return AffinityFigures(
        hit_rate=hits / queries if queries else math.nan,
        ttft_mean=statistics.mean(firsts) if firsts else math.nan,
        ttft_p50=pct(firsts, 0.5),
        ttft_p99=pct(firsts, 0.99),
        usual=usual,
        homes=homes,
        answered=len(answered),
        failed=run.failed + run.turned_away,
    )


# --- 3. scale-up from parked against from stopped -------------------------------------


@dataclass
class StepFigures:
    early: list[str]  # replicas besides the first that answered before the step
    recovered: float | None  # seconds from the step; None: not by the end
    high_seconds: float
    first_answers: dict[str, float]  # replica -> its first answer, seconds from the step
    turned_away: int
    failed: int
    p50: float
    p99: float


def scale_up(server: Server, settings: Settings, seed: int) -> dict[str, StepFigures]:
    s = settings
    print(f"\n3. scale-up: {' '.join(SCALED_REPLICAS)} --target-concurrency "
          f"{STEP_TARGET_CONCURRENCY} --idle-park-seconds {s.idle_park_seconds}; the engine "
          f"loads in {s.load_seconds:g} s (a start) and wakes in {s.wake_seconds:g} s",
          flush=True)  # fmt: skip
    print(f"   Poisson at {LOW_RATE:.0f}/s, then from the step {HIGH_RATE:.0f}/s "
          f"({HIGH_RATE / ENGINE_RATE:.2f} engines' worth), at most {STEP_CAP} outstanding; "
          f"back under the bound: the p{BOUND_QUANTILE * 100:.0f} latency of each "
          f"{BIN_SECONDS:g} s of arrivals at most {BOUND_SECONDS * 1000:.0f} ms and none "
          "turned away, to the end", flush=True)  # fmt: skip
    server.engine("slow-start", max_concurrency=SLOTS, tokens_per_second=TOKENS_PER_SECOND,
                  completion_tokens=MAX_TOKENS,
                  load_seconds=s.load_seconds, wake_seconds=s.wake_seconds,
                  sleep_seconds=s.wake_seconds, weights_bytes=WEIGHTS)  # fmt: skip
    name = "step"
    server.deployment(name, "slow-start", *SCALED_REPLICAS, "--target-concurrency",
                      str(STEP_TARGET_CONCURRENCY), "--idle-park-seconds",
                      str(s.idle_park_seconds), "--weights-size", WEIGHTS)  # fmt: skip
    server.capyctl("deployment", "start", name)
    figures: dict[str, StepFigures] = {}
    extras = slice(1, SCALED_MAX)
    states = server.states(name)
    if states[extras] != ["stopped"] * (SCALED_MAX - 1):
        raise RuntimeError(f"{name}: the extra replicas are not stopped before the step ({states})")
    figures["stopped"] = asyncio.run(_step_run(server, name, s, s.stopped_high_seconds, seed))
    # Idle, the extra replicas are parked (the first one too, as the model parks whole).
    server.wait_states(name, lambda st: st[extras] == ["parked"] * (SCALED_MAX - 1),
                       s.idle_park_seconds + 60, "the extra replicas parked")  # fmt: skip
    modes = ", ".join(str(r.get("parked_mode")) for r in server.replicas(name)[extras])
    figures["parked"] = asyncio.run(_step_run(server, name, s, s.parked_high_seconds, seed))
    server.stop(name)
    print(f"   {'extra replicas':<18}  {'back under the bound':>20}  {'p50 ms':>7}  {'p99 ms':>7}"
          f"  {'turned away':>11}  {'failed':>6}  first answer of each replica (s after the "
          "step)", flush=True)  # fmt: skip
    for label, key in ((f"parked ({modes})", "parked"), ("stopped", "stopped")):
        f = figures[key]
        back = f"{f.recovered:.1f} s" if f.recovered is not None else f"> {f.high_seconds:g} s"
        firsts = ", ".join(f"{r} {t:+.1f}" for r, t in sorted(f.first_answers.items(),
                                                               key=lambda kv: kv[1]))  # fmt: skip
        print(f"   {label:<18}  {back:>20}  {f.p50:>7.1f}  {f.p99:>7.1f}  {f.turned_away:>11}  "
              f"{f.failed:>6}  {firsts}", flush=True)  # fmt: skip
        if f.early:
            print(f"      not a step from one replica: {', '.join(f.early)} answered before it",
                  flush=True)  # fmt: skip
    return figures


async def _step_run(
    server: Server, name: str, settings: Settings, high_seconds: float, seed: int
) -> StepFigures:
    low = settings.low_seconds
    async with Lanes(server, STEP_CAP) as lanes:
        # One request alone first: it wakes the first replica where it was parked for
        # idleness (requests piling up behind a wake would call for more replicas before
        # the step); the load follows at once, before it can go idle again.
        first = Answer(arrival=0.0)
        await ask(lanes, chat(name, "one request first"), first, time.perf_counter())
        if first.status != 200:
            raise RuntimeError(f"{name}: the first request got {first.status}")

        def body(i: int) -> tuple[dict[str, Any], int]:
            return chat(name, f"request {i}: what do capybaras eat?"), 0

        phases = [(LOW_RATE, low), (HIGH_RATE, high_seconds)]
        run = await open_load(lanes, phases, body, STEP_CAP, seed)
    early = {a.replica for a in run.answers if a.arrival < low and a.status == 200}
    after = [a for a in run.answers if a.arrival >= low]
    bins: dict[int, list[Answer]] = defaultdict(list)
    for a in after:
        bins[int((a.arrival - low) / BIN_SECONDS)].append(a)
    count = math.ceil(high_seconds / BIN_SECONDS)

    def good(index: int) -> bool:
        answers = bins.get(index, [])
        latencies = [a.latency for a in answers if a.status == 200 and a.latency is not None]
        if not latencies or len(latencies) < len(answers):
            return False
        return pct(latencies, BOUND_QUANTILE) <= BOUND_SECONDS

    recovered: float | None = None
    for index in range(count - 1, -1, -1):
        if not good(index):
            break
        recovered = index * BIN_SECONDS
    if recovered is not None and recovered > high_seconds - 2:
        recovered = None  # under the bound only at the very end: not settled
    firsts: dict[str, float] = {}
    for a in sorted(after, key=lambda a: a.done):
        if a.status == 200 and a.replica not in firsts:
            firsts[a.replica] = a.done - low
    latencies = [a.latency * 1000 for a in after if a.status == 200 and a.latency is not None]
    return StepFigures(
        early=sorted(early - {first.replica}),
        recovered=recovered,
        high_seconds=high_seconds,
        first_answers=firsts,
        turned_away=sum(1 for a in after if a.status == 0),
        failed=sum(1 for a in after if a.status not in (0, 200)),
        p50=pct(latencies, 0.5),
        p99=pct(latencies, 0.99),
    )


# --- the run --------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "met" if value >= target else "NOT met"


@contextlib.contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does (the clean-up runs)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (under 2 minutes)")
    parser.add_argument("--parts", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    started = time.monotonic()
    load = os.getloadavg()[0]
    print(f"replicas bench ({'quick' if args.quick else 'full'}): CapyCTL standalone, "
          f"simulated GPUs {GPUS}, models of {MODEL_MEMORY}; {os.cpu_count()} cores, load "
          f"average {load:.1f} at the start", flush=True)  # fmt: skip
    server = Server()
    results: dict[str, Any] = {}
    interrupted = False
    with terminated_as_interrupt():
        try:
            server.start()
            if 1 in args.parts:
                results["throughput"] = throughput(server, settings, args.seed)
            if 2 in args.parts:
                results["affinity"] = affinity(server, settings, args.seed)
            if 3 in args.parts:
                results["scale"] = scale_up(server, settings, args.seed)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping what this run started", file=sys.stderr, flush=True)
        except Exception:
            tail = server.log_tail()
            if tail:
                print(f"the server's log, its end:\n{tail}", file=sys.stderr)
            raise
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # clean up whole
            try:
                server.close()
            finally:
                signal.signal(signal.SIGINT, previous)
    if interrupted:
        sys.exit(130)
    summary(results)
    print(f"({time.monotonic() - started:.0f} s in all; load average "
          f"{os.getloadavg()[0]:.1f} at the end)")  # fmt: skip


def summary(results: dict[str, Any]) -> None:
    print("\nsummary (ratios of this run)")
    if "throughput" in results:
        rates = results["throughput"]
        two, four = rates[2] / rates[1], rates[4] / rates[1]
        print(f"  throughput, 2 vs 1 replicas:  {two:.2f}x  (target >= {TARGETS['two']}: "
              f"{verdict(two, TARGETS['two'])})")  # fmt: skip
        print(f"  throughput, 4 vs 1 replicas:  {four:.2f}x  (target >= {TARGETS['four']}: "
              f"{verdict(four, TARGETS['four'])})")  # fmt: skip
    if "affinity" in results:
        f = results["affinity"]
        ratio = f["affinity"].hit_rate / max(f["least-load"].hit_rate, 1e-9)
        print(f"  prefix-cache hit rate, affinity vs least-load:  {ratio:.2f}x  "
              f"({f['affinity'].hit_rate:.1%} vs {f['least-load'].hit_rate:.1%}; target >= "
              f"{TARGETS['affinity']:g}: {verdict(ratio, TARGETS['affinity'])})")  # fmt: skip
    if "scale" in results:
        f = results["scale"]
        parked, stopped = f["parked"].recovered, f["stopped"].recovered
        if f["parked"].early or f["stopped"].early:
            print("  scale-up: not measured (extra replicas answered before the step)")
        elif parked is None:
            print("  scale-up: waking did not bring latency back under the bound: no ratio "
                  f"(target >= {TARGETS['scale']:g}x sooner: NOT met)")  # fmt: skip
        else:
            whole = stopped if stopped is not None else f["stopped"].high_seconds
            ratio = whole / max(parked, BIN_SECONDS)
            more = "" if stopped is not None else "more than "
            print(f"  back under the bound, from parked vs from stopped:  {more}{ratio:.1f}x "
                  f"sooner ({parked:.1f} s vs {more}{whole:.1f} s; target >= "
                  f"{TARGETS['scale']:g}x: {verdict(ratio, TARGETS['scale'])})")  # fmt: skip


if __name__ == "__main__":
    main()
