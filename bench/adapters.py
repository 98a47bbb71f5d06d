"""Adapters: twenty fine-tunes as LoRA adapters of one base engine, against the same twenty
as whole models, on the same skewed trace, in the same run.

Each half runs on a fresh standalone CapyCTL (``capyctl start standalone`` as a program,
tests/live_server.py) with one simulated GPU of 80 GiB and simulated vLLM engines:

- ``adapters``: one base model of 16 GiB with ``--adapter-slots 4``, and twenty adapters
  (folders with an ``adapter_config.json`` of rank 8, made in the server's temporary
  folder; ``capyctl adapter add lora-N --base base --source DIR``). A load takes
  ``CAPYCTL_SIM_LORA_LOAD_SECONDS`` (`--lora-load`, the simulator's default 0.05 s).
- ``whole models``: twenty deployments of 16 GiB each on the same GPU, so four are resident
  at once (as many as the base's adapter slots; the fifth would need 80 GiB and parked
  models keep 256 MiB each on the GPU). A park takes ``CAPYCTL_SIM_SLEEP_SECONDS`` 0.2 s
  and a wake ``CAPYCTL_SIM_WAKE_SECONDS`` 0.5 s (`--park`, `--wake`; bench/contention.py's
  values: the simulator's own default of 0 s would make a switch free in the engine, and
  a real wake of 16 GiB from host RAM takes a second or more). Their weights are declared
  512 MiB (``--weights-size`` and the engine's) so that every parked copy fits this
  machine's RAM; the simulated engine moves no bytes, so this changes no timing.

Both: an answer is 16 tokens at 100 tokens a second (160 ms in the engine), as in
bench/contention.py; ``CAPYCTL_MIN_READY_SECONDS=0`` and turns of 5 s (`--turn`), as there.

The trace: `--requests` requests (default 160), each for model (adapter) number k of 20
with probability proportional to 1 / (k + 1) ** `--zipf` (1.1), drawn from `--seed`, the
same in both halves. Eight clients (`--clients`) take the trace's requests in turn (client
c the c-th, (c + 8)-th, ...), each sending its own one after another (plain, not
streamed). Before the clock each model (adapter) is asked for once, the least popular
first, so both halves start with the four most popular ones resident.

Printed for each half: requests served and errors (by status and code), adapter loads and
model switches per 100 requests (from the server's events during the trace: loads are
``adapter.loaded``; switches are parks and stops, ``deployment.parked`` and
``deployment.stopped``, with wakes and starts beside them), the share of answers that
carried ``x-capyctl-switch`` and the steps those headers name (every request that waited
for a load carries it, so it can name one load more than once), and the p50 and p99 of
the answers' wall time (sent to whole answer: 160 ms of it is the engine writing), of
``x-capyctl-queued-ms`` and of ``x-capyctl-overhead-ms``; then the two halves side by
side, with the ratios of their waits. The waits are the served answers': a request
refused (503 ``adapter_slots_busy``, when every adapter slot serves a request) is
answered at once and counted with the errors. `--retries N` asks again after such a 503's
``Retry-After``, up to N times, as the openai client does; its wall time then counts from
the first try.

`--count` changes the number of fine-tunes (20); tests/test_bench_adapters.py runs a few.

Run: .venv/bin/python bench/adapters.py [--requests 160] [--seed 7] [--zipf 1.1] [--retries 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the server harness is the tests' own: tests/live_server.py
from tests.live_server import LiveServer, sim_engine  # noqa: E402 - importable from ROOT only

GPU = "80GiB"
MODEL_MEMORY = "16GiB"
WEIGHTS = "512MiB"
SLOTS = 4
RANK = 8
TOKENS = 16
TOKENS_PER_SECOND = 100
SWITCH_EVENTS = ("deployment.parked", "deployment.stopped")
BRING_EVENTS = ("deployment.woke", "deployment.ready")


@dataclass
class Outcome:
    """One half's figures."""

    name: str
    requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    wall_ms: list[float] = field(default_factory=list)
    queued_ms: list[float] = field(default_factory=list)
    overhead_ms: list[float] = field(default_factory=list)
    retried: int = 0  # 503s with Retry-After asked again (--retries)
    switch_headers: int = 0
    steps: Counter[str] = field(default_factory=Counter)  # x-capyctl-switch's, by verb
    seconds: float = 0.0
    events: Counter[str] = field(default_factory=Counter)

    @property
    def served(self) -> int:
        return self.requests - sum(self.errors.values())

    def per_100(self, *kinds: str) -> float:
        return 100 * sum(self.events[k] for k in kinds) / max(self.requests, 1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def trace(args: argparse.Namespace) -> list[int]:
    """The requests' models by number (0 the most popular), the same in both halves."""
    rng = random.Random(args.seed)
    weights = [1 / (k + 1) ** args.zipf for k in range(args.count)]
    return rng.choices(range(args.count), weights=weights, k=args.requests)


def server_for(args: argparse.Namespace) -> LiveServer:
    return LiveServer(
        gpus=GPU,
        settings={"CAPYCTL_MIN_READY_SECONDS": "0", "CAPYCTL_MAX_TURN_SECONDS": str(args.turn)},
        prefix="capyctl-bench-adapters-",
    )


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "CAPYCTL_SIM_WEIGHTS_BYTES": WEIGHTS,
        "CAPYCTL_SIM_SLEEP_SECONDS": str(args.park),
        "CAPYCTL_SIM_WAKE_SECONDS": str(args.wake),
        "CAPYCTL_SIM_LORA_LOAD_SECONDS": str(args.lora_load),
        "CAPYCTL_SIM_TOKENS_PER_SECOND": str(TOKENS_PER_SECOND),
        "CAPYCTL_SIM_COMPLETION_TOKENS": str(TOKENS),
    }


def deployment(name: str, *flags: str) -> list[str]:
    return ["deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
            "--gpu-memory", MODEL_MEMORY, "--weights-size", WEIGHTS, *flags]  # fmt: skip


async def ask(client: httpx.AsyncClient, model: str, outcome: Outcome | None,
              retries: int = 0) -> None:  # fmt: skip
    body = {"model": model, "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": "what do capybaras eat?"}]}  # fmt: skip
    sent = time.perf_counter()
    reply = await client.post("/v1/chat/completions", json=body)
    for _ in range(retries):  # as the openai client does: after Retry-After, again
        if reply.status_code != 503 or "retry-after" not in reply.headers:
            break
        if outcome is not None:
            outcome.retried += 1
        await asyncio.sleep(float(reply.headers["retry-after"]))
        reply = await client.post("/v1/chat/completions", json=body)
    wall = (time.perf_counter() - sent) * 1000
    if outcome is None:  # the warm-up: every answer must come
        if reply.status_code != 200:
            raise RuntimeError(f"warm-up {model}: {reply.status_code} {reply.text[:300]}")
        return
    outcome.requests += 1
    if reply.status_code != 200:
        try:
            code = reply.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
        outcome.errors[f"{reply.status_code} {code}"] += 1
        return
    outcome.wall_ms.append(wall)
    outcome.queued_ms.append(float(reply.headers.get("x-capyctl-queued-ms", "nan")))
    outcome.overhead_ms.append(float(reply.headers.get("x-capyctl-overhead-ms", "nan")))
    switch = reply.headers.get("x-capyctl-switch")
    if switch:
        outcome.switch_headers += 1
        # Counted by verb: "loaded adapter", "unloaded adapter", "parked", "woke"...
        outcome.steps.update(" ".join(step.split()[:2 if "adapter" in step else 1])
                             for step in switch.split("; "))  # fmt: skip


async def drive(server: LiveServer, names: list[str], plan: list[int], clients: int,
                outcome: Outcome | None, *, retries: int = 0) -> None:  # fmt: skip
    headers = {"Authorization": f"Bearer {server.key}"}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=600,
                                 limits=limits, trust_env=False) as client:  # fmt: skip
        if outcome is None:
            for k in plan:  # one after another
                await ask(client, names[k], None)
            return

        async def one_client(mine: list[int]) -> None:
            for k in mine:
                await ask(client, names[k], outcome, retries)

        started = time.perf_counter()
        await asyncio.gather(*(one_client(plan[c::clients]) for c in range(clients)))
        outcome.seconds = time.perf_counter() - started


def run_half(args: argparse.Namespace, kind: str, plan: list[int]) -> Outcome:
    server = server_for(args)
    outcome = Outcome(kind)
    try:
        if kind == "adapters":
            folders = server.data / "loras"
            names = [f"lora-{k}" for k in range(args.count)]
            for name in names:
                (folders / name).mkdir(parents=True)
                (folders / name / "adapter_config.json").write_text(
                    json.dumps({"r": RANK, "peft_type": "LORA"})
                )
            server.start(
                sim_engine("sim", engine_env(args)),
                deployment("base", "--adapter-slots", str(SLOTS)),
                *(["adapter", "add", n, "--base", "base", "--source", str(folders / n)]
                  for n in names),
            )  # fmt: skip
            server.commands(["deployment", "start", "base"])
        else:
            names = [f"model-{k}" for k in range(args.count)]
            server.start(sim_engine("sim", engine_env(args)), *(deployment(n) for n in names))
        # Every one asked for once, the least popular first: the four most popular end
        # resident, and no first start or first load counts in the trace.
        asyncio.run(drive(server, names, list(range(args.count - 1, -1, -1)), 1, None))
        before = server.settled().last_event_id
        asyncio.run(drive(server, names, plan, args.clients, outcome, retries=args.retries))
        outcome.events = Counter(e["kind"] for e in server.settled(before).events)
    except Exception:
        print(f"the server's log, its end:\n{server.log()[-3000:]}", file=sys.stderr)
        raise
    finally:
        server.close()
    return outcome


def rows(o: Outcome) -> list[tuple[str, str]]:
    """The half's figures, a label and a value each."""
    events = o.events
    errors = ", ".join(f"{k} x{v}" for k, v in sorted(o.errors.items())) or "none"
    steps = ", ".join(f"{k} {v}" for k, v in sorted(o.steps.items())) or "-"
    loads = f"({events['adapter.loaded']} loaded, {events['adapter.unloaded']} unloaded)"
    parks = f"({events['deployment.parked']} parked, {events['deployment.stopped']} stopped)"
    brings = f"{events['deployment.woke']}, {events['deployment.ready']}"
    switched = f"{100 * o.switch_headers / max(o.served, 1):.1f}%"
    rate = f"{o.served / max(o.seconds, 1e-9):.1f} ({o.seconds:.1f} s)"

    def p50_p99(values: list[float]) -> str:
        return f"{pct(values, 0.5):.0f} / {pct(values, 0.99):.0f}"

    return [
        ("requests, served", f"{o.requests}, {o.served}"),
        ("errors", errors),
        ("  asked again after a 503", str(o.retried)),
        ("adapter loads /100 requests", f"{o.per_100('adapter.loaded'):.1f} {loads}"),
        ("model switches /100 requests", f"{o.per_100(*SWITCH_EVENTS):.1f} {parks}"),
        ("  wakes, starts", brings),
        ("answers with x-capyctl-switch", switched),
        ("  their steps", steps),
        ("wall ms p50 / p99 (served)", p50_p99(o.wall_ms)),
        ("x-capyctl-queued-ms p50 / p99", p50_p99(o.queued_ms)),
        ("x-capyctl-overhead-ms p50 / p99", p50_p99(o.overhead_ms)),
        ("answers/s", rate),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=160, help="in all, shared by the clients")
    parser.add_argument("--count", type=int, default=20, help="fine-tunes (adapters, models)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--zipf", type=float, default=1.1, help="the trace's skew")
    parser.add_argument("--lora-load", type=float, default=0.05, help="an adapter load, s")
    parser.add_argument("--park", type=float, default=0.2, help="a model's park, s")
    parser.add_argument("--wake", type=float, default=0.5, help="a model's wake, s")
    parser.add_argument("--turn", type=int, default=5, help="max_turn_seconds")
    parser.add_argument("--retries", type=int, default=0,
                        help="ask again after a 503 with Retry-After, so many times")  # fmt: skip
    args = parser.parse_args()
    plan = trace(args)
    shares = Counter(plan)
    top = sum(shares[k] for k in range(SLOTS)) / len(plan)
    print(f"{args.count} fine-tunes, {args.requests} requests from {args.clients} clients, Zipf "
          f"{args.zipf:g} (seed {args.seed}: the {SLOTS} most asked for take {top:.0%}, "
          f"{len(shares)} of {args.count} asked for); simulated GPU {GPU}, models of {MODEL_MEMORY}; "
          f"adapter load {args.lora_load:g} s, {SLOTS} slots; model park {args.park:g} s, "
          f"wake {args.wake:g} s, {SLOTS} resident; answers {TOKENS} tokens at "
          f"{TOKENS_PER_SECOND}/s; turns of {args.turn} s; a 503 with Retry-After asked again "
          f"{args.retries} times", flush=True)  # fmt: skip
    halves = []
    for kind in ("adapters", "whole models"):
        halves.append(run_half(args, kind, plan))
        print(f"  {kind}: done", flush=True)
    adapters, whole = halves
    print(f"\n  {'':<32}  {'adapters (one base)':<38}  whole models")
    for (label, left), (_, right) in zip(rows(adapters), rows(whole), strict=True):
        print(f"  {label:<32}  {left:<38}  {right}")
    switched = sum(adapters.events[k] for k in (*SWITCH_EVENTS, *BRING_EVENTS))
    verdict = "none, as it should be" if not switched else "NOT none"
    print(f"\nmodel switches with adapters: {switched} ({verdict}: "
          f"{', '.join(SWITCH_EVENTS + BRING_EVENTS)} events during the trace)")  # fmt: skip
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        a, w = pct(adapters.wall_ms, q), pct(whole.wall_ms, q)
        print(f"wall {label}, whole models / adapters: {w / max(a, 1e-9):.1f}x "
              f"({w:.0f} vs {a:.0f} ms)")  # fmt: skip
    print(f"whole models' switches /100 against adapter loads /100: "
          f"{whole.per_100(*SWITCH_EVENTS):.1f} vs {adapters.per_100('adapter.loaded'):.1f} "
          f"(in the engine a switch takes {args.park:g} s + {args.wake:g} s, a load "
          f"{args.lora_load:g} s)")  # fmt: skip


if __name__ == "__main__":
    main()
