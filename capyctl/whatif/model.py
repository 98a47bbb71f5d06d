"""The plain data a replay runs on: hosts, models with their settings and timings, and
requests. No database and no clock: a scenario is built from ``capyctl status --json`` (or
the live configuration) by :mod:`capyctl.whatif.scenario`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capyctl.deployments.settings_spec import builtin_default

GIB = 1024**3

# The deployment settings a replay mirrors (capyctl.deployments.settings_spec declares
# each): a SimModel field of the same name, whose default is what the setting comes to
# where nothing overrides the built-in global defaults.
MIRRORED_SETTINGS = (
    "gpus",
    "park",
    "pinned",
    "priority",
    "min_ready_seconds",
    "max_turn_seconds",
    "max_queue_seconds",
    "max_waiting",
    "idle_park_seconds",
    "replicas",
    "min_replicas",
    "target_concurrency",
    "scale_up_wait_seconds",
    "spread",
)


def _default(name: str) -> Any:
    return builtin_default(name)


def _seconds(name: str) -> float:
    return float(builtin_default(name))


# What each kind of engine takes, in seconds, when CapyCTL has not measured it for a model
# yet (its events carry each start, park and wake it timed): typical figures for a model of
# some 8-16 GB. A kind that cannot park never uses its park and wake figures.
KIND_TIMINGS: dict[str, dict[str, float]] = {
    "vllm": {"start": 60.0, "park_ram": 2.0, "park_deep": 1.0, "wake_ram": 3.0,
             "wake_deep": 20.0, "stop": 3.0},
    "sglang": {"start": 60.0, "park_ram": 2.0, "park_deep": 1.0, "wake_ram": 3.0,
               "wake_deep": 20.0, "stop": 3.0},
    "llama-server": {"start": 5.0, "park_ram": 0.0, "park_deep": 0.0, "wake_ram": 0.0,
                     "wake_deep": 0.0, "stop": 1.0},
    "tensorfold": {"start": 30.0, "park_ram": 0.0, "park_deep": 1.0, "wake_ram": 0.0,
                   "wake_deep": 20.0, "stop": 2.0},
    "custom": {"start": 30.0, "park_ram": 2.0, "park_deep": 1.0, "wake_ram": 3.0,
               "wake_deep": 20.0, "stop": 2.0},
}  # fmt: skip
DEFAULT_SERVICE_SECONDS = 1.0  # a request's time in the engine when its trace line lacks it
# An adapter's load, in seconds, where CapyCTL never measured one: ServerlessLLM's measured
# 83.5 ms for a LoRA adapter's load, rounded.
DEFAULT_ADAPTER_LOAD_SECONDS = 0.1
TIMING_NAMES = ("start", "park_ram", "park_deep", "wake_ram", "wake_deep", "stop", "service")


@dataclass
class Timings:
    """Seconds each step takes for one model."""

    start: float = 30.0
    park_ram: float = 2.0
    park_deep: float = 1.0
    wake_ram: float = 3.0
    wake_deep: float = 20.0
    stop: float = 2.0
    service: float = DEFAULT_SERVICE_SECONDS

    @classmethod
    def for_kind(cls, kind: str) -> Timings:
        return cls(**KIND_TIMINGS.get(kind, KIND_TIMINGS["custom"]))

    def park(self, mode: str) -> float:
        return self.park_ram if mode == "ram" else self.park_deep

    def wake(self, mode: str) -> float:
        return self.wake_ram if mode == "ram" else self.wake_deep


@dataclass
class SimHost:
    name: str
    gpus: list[int]  # each GPU's capacity in bytes
    ram_bytes: int
    unified: bool = False
    foreign: dict[str, int] = field(default_factory=dict)  # pool -> what no model holds
    online: bool = True

    @property
    def pools(self) -> dict[str, int]:
        """Pool name -> capacity, named as the ledger names them."""
        if self.unified:
            return {"unified": self.gpus[0] if self.gpus else self.ram_bytes}
        found = {f"gpu{i}": size for i, size in enumerate(self.gpus)}
        found["ram"] = self.ram_bytes
        return found


@dataclass
class SimReplica:
    """Where one of a model's replicas past its first stands when the replay begins: its
    host (None: placed where it fits), its state (stopped, ready or parked) and the GPU
    pools it holds then."""

    host: str | None = None
    state: str = "stopped"
    parked_mode: str = ""
    pools: list[str] = field(default_factory=list)


@dataclass
class SimModel:
    """A deployment and its settings (each already resolved from its own value or the
    global default; :data:`MIRRORED_SETTINGS` default as declared), and where it stands
    when the replay begins."""

    name: str
    kind: str = "vllm"
    host: str | None = None  # None: placed where it fits on its first start
    gpus: int = _default("gpus")
    claim_bytes: int = 16 * GIB  # per GPU
    weights_bytes: int = 8 * GIB  # the copy a ram park keeps in host RAM
    residual_bytes: int | None = None  # what a park leaves on each GPU; None: the policy's guess
    # What its last park on the server left (the scheduler counts on it when it parks the
    # model again); None: never parked there. A park in the replay replaces it.
    measured_residual_bytes: int | None = None
    park: str = _default("park")
    pinned: bool = _default("pinned")
    priority: int = _default("priority")
    min_ready_seconds: float = _seconds("min_ready_seconds")
    max_turn_seconds: float = _seconds("max_turn_seconds")
    max_queue_seconds: float = _seconds("max_queue_seconds")
    max_waiting: int = _default("max_waiting")
    idle_park_seconds: float = _seconds("idle_park_seconds")
    # Its replicas: ``replicas`` engines at most (MAX), ``min_replicas`` kept up while it
    # serves (0: all of them), more brought up by load (docs/replicas.md).
    replicas: int = _default("replicas")
    min_replicas: int = _default("min_replicas")
    target_concurrency: int = _default("target_concurrency")
    scale_up_wait_seconds: float = _seconds("scale_up_wait_seconds")
    spread: str = _default("spread")
    # Requests one engine works on at once; the rest wait in it, in order (0: no limit).
    max_concurrency: int = 0
    # Adapters its engine holds at once (0: it serves none).
    adapter_slots: int = 0
    can_park_ram: bool = True
    can_park_deep: bool = True
    parks_unverified: bool = False  # its engine's parks kept their memory: it is stopped instead
    desired: str = "running"
    aliases: list[str] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    # At the start of the replay: stopped, ready or parked; the GPU pools it holds then.
    state: str = "stopped"
    parked_mode: str = ""
    pools: list[str] = field(default_factory=list)
    # Where its replicas past the first stand at the start (replica 1 first); one not
    # listed is stopped, on ``host``.
    replica_set: list[SimReplica] = field(default_factory=list)

    @property
    def kept_up(self) -> int:
        """How many of its replicas are kept up while it serves."""
        return min(self.min_replicas or self.replicas, self.replicas)


@dataclass
class SimAdapter:
    """A LoRA adapter served as a model by its base's engine (docs/adapters.md): a request
    for it needs its base ready and, where the base's engine does not hold it, a load of
    ``load_seconds`` (``measured``: CapyCTL timed its loads; else the default).
    ``loaded_on``: the engines of its base (NAME, NAME~N) that hold it when a ``--warm``
    replay begins."""

    name: str
    base: str
    load_seconds: float = DEFAULT_ADAPTER_LOAD_SECONDS
    measured: bool = False
    loaded_on: tuple[str, ...] = ()


@dataclass
class Scenario:
    hosts: list[SimHost]
    models: list[SimModel]
    name: str = "current"
    # Server mode sees a request's end only through ``last_request_at``, so a model counts
    # as busy a second longer after it (:func:`capyctl.scheduler.steps.busy_grace`).
    server_mode: bool = False
    adapters: list[SimAdapter] = field(default_factory=list)
    # The keys whose requests are batch (their own class, or their team's): the others'
    # are interactive (:mod:`capyctl.scheduler.turn_rules`).
    batch_keys: frozenset[int] = frozenset()

    def model(self, name: str) -> SimModel | None:
        return next((m for m in self.models if m.name == name or name in m.aliases), None)


@dataclass
class Request:
    """One line of a trace: when it came (seconds from the trace's start), for which model,
    and how long its engine worked on it."""

    at: float
    model: str
    service: float | None = None  # seconds in the engine; None: the model's timing
    key: int | None = None
    stream: bool = False
