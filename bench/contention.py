"""Contending models: turns against a switch on every change of model, in the same run.

Two (or three) simulated vLLM models of 16 GiB share a simulated 24 GiB GPU, so only one
holds it at a time. A park takes 0.2 s and a wake 0.5 s (`--park`, `--wake`); an answer
streams 16 tokens at 100 tokens/s. Eight clients (`--clients`) each send their requests
one after another, through `/v1` of a real standalone CapyCTL, following a seeded trace:

- ``sessions``: each client works with one model for a run of requests (on average
  `--run` long), then with another: apps and people that use a model for a while;
- ``random``: each request picks a model at random.

Each trace runs twice, on a fresh server each time: with turns (`CAPYCTL_MAX_TURN_SECONDS`,
`--turn`) and with a turn of 0, which switches whenever a request for another model
waits (what a process-swapping proxy does: FIFO on the head of the queue). Printed per
run: switches (parks) per 100 requests, p50 and p99 of the time requests queued
(`x-capyctl-queued-ms`), requests per second, and errors; then the ratios, and the wait
bound of docs/switching.md for the settings used.

Run: .venv/bin/python bench/contention.py [--seed 7] [--requests 40] [--turn 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the server harness is the tests' own: tests/live_server.py
from tests.live_server import LiveServer, sim_engine  # noqa: E402 - importable from ROOT only


@dataclass
class Outcome:
    name: str
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    queued_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    parks: int = 0
    stops: int = 0

    @property
    def switches(self) -> int:
        return self.parks + self.stops

    def p99(self) -> float:
        waits = sorted(self.queued_ms) or [0.0]
        return waits[min(len(waits) - 1, int(len(waits) * 0.99))]

    def line(self) -> str:
        waits = sorted(self.queued_ms) or [0.0]
        p99 = self.p99()
        errors = sum(self.errors.values())
        return (
            f"{self.name:<22} {self.requests:>5} req  {100 * self.switches / self.requests:5.1f} "
            f"switches/100  wait p50 {statistics.median(waits) / 1000:5.2f} s  "
            f"p99 {p99 / 1000:5.2f} s  {self.requests / self.seconds:5.1f} req/s  "
            f"errors {errors}" + (f" {self.errors}" if errors else "")
        )


def traces(kind: str, args: argparse.Namespace, models: list[str]) -> list[list[str]]:
    """Each client's models, request by request: the same for both strategies."""
    rng = random.Random(args.seed)
    requests, run = args.requests, args.run
    out = []
    for _ in range(args.clients):
        sequence: list[str] = []
        current = rng.choice(models)
        while len(sequence) < requests:
            if kind == "random":
                sequence.append(rng.choice(models))
                continue
            sequence.append(current)
            if rng.random() < 1 / run:  # the session ends: on to another model
                current = rng.choice([m for m in models if m != current])
        out.append(sequence)
    return out


def start_server(args: argparse.Namespace, models: list[str], turn: int) -> LiveServer:
    """A fresh standalone server with the models, each of 16 GiB, on a simulated engine."""
    server = LiveServer(
        settings={"CAPYCTL_MIN_READY_SECONDS": "0", "CAPYCTL_MAX_TURN_SECONDS": str(turn)},
        prefix="capyctl-contention-",
    )
    sim_env = {
        "CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB",
        "CAPYCTL_SIM_SLEEP_SECONDS": str(args.park),
        "CAPYCTL_SIM_WAKE_SECONDS": str(args.wake),
        "CAPYCTL_SIM_TOKENS_PER_SECOND": "100",
        "CAPYCTL_SIM_COMPLETION_TOKENS": "16",
    }
    deployments = (["deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
                    "--gpu-memory", "16GiB"] for name in models)  # fmt: skip
    try:
        server.start(sim_engine("sim", sim_env), *deployments)
    except BaseException:
        server.close()
        raise
    return server


async def drive(server: LiveServer, plan: list[list[str]], outcome: Outcome) -> None:
    headers = {"Authorization": f"Bearer {server.key}"}
    limits = httpx.Limits(max_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=600,
                                 limits=limits) as client:  # fmt: skip

        async def one_client(models: list[str]) -> None:
            for model in models:
                body = {"model": model, "max_tokens": 16, "stream": True,
                        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
                async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                    async for _ in reply.aiter_bytes():
                        pass
                    outcome.requests += 1
                    if reply.status_code != 200:
                        code = str(reply.status_code)
                        outcome.errors[code] = outcome.errors.get(code, 0) + 1
                        continue
                    outcome.queued_ms.append(float(reply.headers["x-capyctl-queued-ms"]))

        started = time.perf_counter()
        await asyncio.gather(*(one_client(models) for models in plan))
        outcome.seconds = time.perf_counter() - started


def run_one(args: argparse.Namespace, kind: str, strategy: str, turn: int,
            models: list[str]) -> Outcome:  # fmt: skip
    plan = traces(kind, args, models)
    server = start_server(args, models, turn)
    outcome = Outcome(f"{kind}, {strategy}")
    try:
        # Every model started once before the clock runs (the first starts are not switches).
        _, before = server.commands_then_snapshot(*(["deployment", "start", m] for m in models))
        asyncio.run(drive(server, plan, outcome))
        kinds = [event["kind"] for event in server.snapshot(before.last_event_id).events]
        outcome.parks = kinds.count("deployment.parked")
        outcome.stops = kinds.count("deployment.stopped")
    finally:
        server.close()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=40, help="per client")
    parser.add_argument("--models", type=int, default=2, choices=(2, 3))
    parser.add_argument("--run", type=float, default=10.0, help="mean session length")
    parser.add_argument("--turn", type=int, default=5, help="max_turn_seconds for turns")
    parser.add_argument("--park", type=float, default=0.2)
    parser.add_argument("--wake", type=float, default=0.5)
    parser.add_argument("--traces", default="sessions,random")
    args = parser.parse_args()
    models = ["a", "b", "c"][: args.models]
    print(f"{args.clients} clients x {args.requests} requests, {args.models} models of 16 GiB "
          f"on one 24 GiB GPU; park {args.park} s, wake {args.wake} s; seed {args.seed}")  # fmt: skip
    for kind in args.traces.split(","):
        turns = run_one(args, kind, f"turns of {args.turn} s", args.turn, models)
        print(turns.line(), flush=True)
        within = "within" if turns.p99() <= bound(args) * 1000 else "PAST"
        print(f"  p99 wait {turns.p99() / 1000:.2f} s: {within} the bound, {bound(args):.1f} s")
        fifo = run_one(args, kind, "switch on change", 0, models)
        print(fifo.line(), flush=True)
        fewer = fifo.switches / max(turns.switches, 1)
        faster = (turns.requests / turns.seconds) / (fifo.requests / fifo.seconds)
        print(f"  {kind}: {fewer:.1f}x fewer switches with turns, {faster:.2f}x the throughput")
    print(f"wait bound for turns (docs/switching.md): (models - 1) x (turn + longest request) "
          f"+ models x (park + wake + 0.25 s) = {bound(args):.1f} s")  # fmt: skip


def bound(args: argparse.Namespace) -> float:
    longest = 16 / 100  # an answer: 16 tokens at 100 a second
    return (args.models - 1) * (args.turn + longest) + args.models * (args.park + args.wake + 0.25)


if __name__ == "__main__":
    main()
