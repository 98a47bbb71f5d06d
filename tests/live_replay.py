"""Replay a request trace, open loop, through a real standalone CapyCTL with simulated
engines, and report what the server switched.

Agreement tests run the same short trace through :func:`replay` and through the what-if
simulator (``capyctl simulate``): switch counts must agree exactly, waits within a
tolerance. So the run is made as well defined as the server allows, and reported as the
server recorded it.

The server (:class:`tests.live_server.LiveServer`): one simulated host with the GPUs of
``gpus`` (``CAPYCTL_SIM_GPUS``), no GPU reserve (``CAPYCTL_GPU_RESERVE=0``: a pool's
capacity is its GPU's size), no idle parks (``CAPYCTL_IDLE_PARK_SECONDS=0``: a model gives
up its GPU only to make room), and for each :class:`LiveModel` a simulated vLLM engine of
its own, whose claim and weights copy are the model's (``CAPYCTL_SIM_GPU_BYTES``,
``CAPYCTL_SIM_WEIGHTS_BYTES``; 256 MiB stay on the GPU while it is parked), and a
deployment with the model's settings given explicitly. ``settings`` (``CAPYCTL_*``) go
last and override these.

What the engines take (:class:`LiveTimings`): a start ``start``
(``CAPYCTL_SIM_LOAD_SECONDS``) plus the engine program's own start-up (its imports: half a
second on 2 cores); a park ``park_ram`` or ``park_deep`` (vLLM sleep level 1 or 2); a wake
``wake_ram`` or ``wake_deep`` (a deep wake's time is spent reloading the weights). CapyCTL
adds a few tens of milliseconds to each: a start's health check and one-token warm-up, a
park's wait for the GPU probe to see the memory freed (polled every 50 ms), a wake's
health check. Each event's ``duration_ms`` says what that switch took
(:attr:`LiveResult.switch_seconds`; a wake's and a start's hold the parks that made room
for them).

A request's service time: each is a non-streamed chat completion whose ``max_tokens`` the
engine answers in full (its own cap is out of reach) at ``tokens_per_second``, in one wait
of ``tokens / tokens_per_second``. A trace row's service time is its ``duration_ms`` less
its ``queued_ms`` (as the what-if simulator reads a trace; ``queued_ms`` absent: 0) when
the row has a ``duration_ms`` and a ``status`` of 200 or none, else its
``completion_tokens`` (default 16) at ``tokens_per_second``; the tokens sent are
``round(seconds * tokens_per_second)``, at least 1, so service times are exact to
``1 / tokens_per_second`` (10 ms at the default 100 tokens/s).

The clock: with ``prestart`` each model is started once, in the order given, before it
runs (a model that does not fit beside the others makes room as any start does, so the
earlier ones may be parked or stopped: :attr:`LiveResult.initial` says how each stands,
and :attr:`LiveResult.status` is ``capyctl status --json`` at that moment); only what
happens after counts. Each request is sent at its ``at`` (seconds from the clock's start)
whether or not earlier ones were answered.

What the harness cannot pin down, so agreement tests should keep clear of it or allow for it:

- host RAM is the machine's own: a ``ram`` park needs its weights copy to fit in free host
  RAM (less ``CAPYCTL_RAM_RESERVE``), else the model parks ``deep`` (the switch counts say
  so: ``park deep``);
- least recently used is known to the second (``last_request_at`` is written at most once
  a second): with three models or more, victims whose last requests came within a second
  of each other may be picked either way;
- a switch that waits for something that passes (a busy model's turn, one inside its
  ``min_ready_seconds``) tries again after 0.1 s, then every 0.25 s, so the wait ends up
  to a quarter second after what it waited for;
- a loaded machine stretches every step: keep gaps between bursts wide of a switch.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.live_server import LiveServer, LiveServerError, sim_engine

# Switch counts are keyed by these, from the events recorded after the clock starts.
SWITCH_KEYS = ("start", "wake ram", "wake deep", "park ram", "park deep", "stop", "fail")
DEFAULT_COMPLETION_TOKENS = 16
LEAD_SECONDS = 0.3  # from setting the senders up to the clock's start: none starts late
ENGINE_TOKEN_CAP = 10**9  # the engines' own answer length: every max_tokens is below it
BASE_SETTINGS = {
    "CAPYCTL_GPU_RESERVE": "0",
    "CAPYCTL_IDLE_PARK_SECONDS": "0",
}


@dataclass(frozen=True)
class LiveModel:
    """One deployment of the replay, with its settings (each given to the server
    explicitly, never left to a default)."""

    name: str
    gpu_memory: str = "16GiB"  # claim per GPU
    weights: str = "8GiB"  # weights copy size (what a ram park keeps in host RAM)
    min_ready_seconds: int = 0
    max_turn_seconds: int = 5
    park: str = "auto"  # auto | ram | deep | stop
    priority: int = 0
    pinned: bool = False

    def add_command(self) -> list[str]:
        command = [
            "deployment", "add", self.name, "--engine", f"sim-{self.name}",
            "--source", f"m-{self.name}", "--gpu-memory", self.gpu_memory,
            "--weights-size", self.weights, "--park", self.park,
            "--min-ready-seconds", str(self.min_ready_seconds),
            "--max-turn-seconds", str(self.max_turn_seconds),
            "--idle-park-seconds", "0", "--priority", str(self.priority),
        ]  # fmt: skip
        return [*command, "--pinned"] if self.pinned else command


@dataclass(frozen=True)
class LiveTimings:
    """Seconds each step takes in the simulated engines, and their pace."""

    start: float = 0.5
    park_ram: float = 0.2
    park_deep: float = 0.1
    wake_ram: float = 0.5
    wake_deep: float = 0.8
    tokens_per_second: float = 100.0

    def engine_env(self, model: LiveModel) -> dict[str, str]:
        return {
            "CAPYCTL_SIM_LOAD_SECONDS": str(self.start),
            "CAPYCTL_SIM_SLEEP_SECONDS": str(self.park_ram),
            "CAPYCTL_SIM_DEEP_SLEEP_SECONDS": str(self.park_deep),
            "CAPYCTL_SIM_WAKE_SECONDS": str(self.wake_ram),
            "CAPYCTL_SIM_DEEP_WAKE_SECONDS": str(self.wake_deep),
            "CAPYCTL_SIM_TOKENS_PER_SECOND": str(self.tokens_per_second),
            "CAPYCTL_SIM_COMPLETION_TOKENS": str(ENGINE_TOKEN_CAP),
            "CAPYCTL_SIM_GPU_BYTES": model.gpu_memory,
            "CAPYCTL_SIM_WEIGHTS_BYTES": model.weights,
        }


@dataclass
class LiveResult:
    """What the server did during the replay.

    - ``switches``: counts keyed by :data:`SWITCH_KEYS` (``start`` a start finished, ``wake
      ram|deep``, ``park ram|deep``, ``stop``, ``fail`` a deployment failed), from the
      server's events after the clock started; keys with no switch are absent.
    - ``requests``: one row per trace row, in trace order: ``model``, ``at`` (when it was
      due), ``sent`` (when it went, seconds from the clock's start), ``tokens`` (its
      max_tokens), ``status`` (0: no HTTP answer), ``code`` (the OpenAI error code, or the
      transport error's name; None for a 200), ``queued_ms`` (``x-capyctl-queued-ms``, None
      when absent) and ``seconds`` (its duration at the client).
    - ``events``: the server's events after the clock started, oldest first, each with
      ``at`` (when it was recorded, at the end of its step: seconds from the clock's
      start), ``kind``, ``subject``, ``message``, ``duration_ms`` and ``data`` (a park's
      or wake's ``mode``).
    - ``initial``: each model's state when the clock started: ``ready``, ``parked ram``,
      ``parked deep``, ``stopped`` (or any other observed state, as it was).
    - ``status``: ``capyctl status --json`` when the clock started (pools with their
      capacities and use, deployments, the ledger), to build a simulator's scenario from.
    - ``switch_seconds``: what each switch took (its event's ``duration_ms``), by the keys
      of ``switches``, in order. A wake's and a start's count from when they were asked,
      so they hold the parks and stops that made room for them.
    """

    switches: collections.Counter[str]
    requests: list[dict[str, Any]]
    events: list[dict[str, Any]]
    initial: dict[str, str] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    switch_seconds: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> str:
        """Lines for an assertion's message: the counts, the start, each request and each
        deployment's event."""
        lines = [f"switches {dict(self.switches)}; initial {self.initial}"]
        lines += [
            f"{r['at']:7.2f} sent {r['sent']:7.2f} {r['model']:<8} {r['status']} "
            f"{r['code'] or '':<16} queued {r['queued_ms']} ms, {r['seconds']:.2f} s"
            for r in self.requests
        ]
        lines += [
            f"{e['at']:7.2f} {e['kind']:<24} {e['message']} ({e['duration_ms']} ms)"
            for e in self.events
            if e["kind"].startswith("deployment.")
        ]
        return "\n".join(lines)


def service_tokens(row: dict[str, Any], tokens_per_second: float) -> int:
    """The max_tokens that make this trace row's service time (see the module's doc)."""
    duration, queued = row.get("duration_ms"), row.get("queued_ms")
    if duration is not None and row.get("status") in (None, 200):
        seconds = max(float(duration) - float(queued or 0), 0.0) / 1000
        return max(1, round(seconds * tokens_per_second))
    return max(1, int(row.get("completion_tokens", DEFAULT_COMPLETION_TOKENS)))


def switch_key(event: dict[str, Any]) -> str | None:
    """The key of :attr:`LiveResult.switches` an event counts under, if any."""
    mode = (event.get("data") or {}).get("mode", "")
    return {
        "deployment.ready": "start",
        "deployment.woke": f"wake {mode}",
        "deployment.parked": f"park {mode}",
        "deployment.stopped": "stop",
        "deployment.failed": "fail",
    }.get(event["kind"])


def replay(
    trace: list[dict[str, Any]],
    models: list[LiveModel],
    *,
    gpus: str = "24GiB",
    timings: LiveTimings = LiveTimings(),
    settings: dict[str, str] | None = None,
    prestart: bool = True,
    request_timeout: float = 300.0,
    classes: bool = True,
) -> LiveResult:
    """Run ``trace`` through a fresh server that serves ``models`` on ``gpus``, and report
    what it switched (see the module's doc for how the run is set up and timed).

    Rows with ``"class": "batch"`` are sent with a second key, made with ``--class batch``
    (``classes=False``: ``--class interactive``, to compare the same trace without
    classes); the others with the admin key, interactive."""
    if timings.tokens_per_second <= 0:
        raise ValueError("tokens_per_second must be above 0: service times are set with it")
    if any(not isinstance(row.get("at"), int | float) or row["at"] < 0 for row in trace):
        raise ValueError("every trace row needs an `at`: seconds from the clock's start, >= 0")
    names = {m.name for m in models}
    unknown = sorted({str(row.get("model")) for row in trace} - names)
    if unknown:
        raise ValueError(f"the trace asks for models it does not define: {', '.join(unknown)}")
    server = LiveServer(gpus=gpus, settings={**BASE_SETTINGS, **(settings or {})},
                        prefix="capyctl-replay-")  # fmt: skip
    try:
        setup = [sim_engine(f"sim-{m.name}", timings.engine_env(m)) for m in models]
        server.start(*setup, *(m.add_command() for m in models))
        keys = {"interactive": server.key}
        if any(row.get("class") == "batch" for row in trace):
            made = server.commands(["key", "create", "--user", "admin", "--class",
                                    "batch" if classes else "interactive"])  # fmt: skip
            keys["batch"] = made[-1].strip().splitlines()[-1]
        starts = [["deployment", "start", m.name] for m in models] if prestart else []
        outputs, before = server.commands_then_snapshot(*starts, ["status", "--json"])
        status = json.loads(outputs[-1])
        if not before.settled:  # each start waits for its model: this is not expected
            raise LiveServerError(f"the server was still switching: {before.states}")
        initial = {name: f"{state} {mode}".strip() for name, (state, mode) in before.states.items()}
        rows, clock = asyncio.run(_send(server, trace, timings, request_timeout, keys))
        after = server.settled(before.last_event_id)
    except LiveServerError:
        raise
    except Exception as exc:
        tail = server.log()[-4000:]
        raise LiveServerError(f"the replay failed: {exc}\n--- server log ---\n{tail}") from exc
    finally:
        server.close()
    events = [{**e, "at": e["time"] - clock} for e in after.events]
    switches: collections.Counter[str] = collections.Counter()
    switch_seconds: dict[str, list[float]] = {}
    for event in events:
        key = switch_key(event)
        if key is None:
            continue
        switches[key] += 1
        if event["duration_ms"] is not None:
            switch_seconds.setdefault(key, []).append(event["duration_ms"] / 1000)
    return LiveResult(switches, rows, events, initial, status, switch_seconds)


async def _send(
    server: LiveServer,
    trace: list[dict[str, Any]],
    timings: LiveTimings,
    timeout: float,
    keys: dict[str, str],
) -> tuple[list[dict[str, Any]], float]:
    """Send every row at its ``at`` (with the key of its ``class``); the result rows, and
    the clock's start (epoch seconds)."""
    loop = asyncio.get_running_loop()
    headers = {"Authorization": f"Bearer {server.key}"}
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits,
                                 timeout=timeout, trust_env=False) as client:  # fmt: skip
        # The gateway's first request loads what every later one finds ready (the key, the
        # routing table): paid here, not by the trace's first request.
        (await client.get("/v1/models")).raise_for_status()
        zero = loop.time() + LEAD_SECONDS
        wall_zero = time.time() + LEAD_SECONDS

        async def one(row: dict[str, Any]) -> dict[str, Any]:
            at = float(row["at"])
            tokens = service_tokens(row, timings.tokens_per_second)
            await asyncio.sleep(max(zero + at - loop.time(), 0.0))
            sent = loop.time()
            body = {"model": row["model"], "max_tokens": tokens, "stream": False,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            result: dict[str, Any] = {"model": row["model"], "at": at, "sent": sent - zero,
                                      "tokens": tokens,
                                      "class": row.get("class") or "interactive"}  # fmt: skip
            key = keys[str(row.get("class") or "interactive")]
            try:
                reply = await client.post("/v1/chat/completions", json=body,
                                          headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            except httpx.HTTPError as exc:
                return {**result, "status": 0, "code": type(exc).__name__, "queued_ms": None,
                        "seconds": loop.time() - sent}  # fmt: skip
            queued = reply.headers.get("x-capyctl-queued-ms")
            return {
                **result,
                "status": reply.status_code,
                "code": None if reply.status_code == 200 else _error_code(reply),
                "queued_ms": float(queued) if queued is not None else None,
                "seconds": loop.time() - sent,
            }

        rows = await asyncio.gather(*(one(row) for row in trace))
    return list(rows), wall_zero


def _error_code(reply: httpx.Response) -> str | None:
    try:
        error = reply.json().get("error") or {}
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None
