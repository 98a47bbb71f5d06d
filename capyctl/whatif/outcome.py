"""What a replay yields: each request's outcome, each switch, each model's time on a pool,
each scaling step of a model of several replicas, each adapter loaded, the queue's length
over time, and the simulator's own figures (events, plans, time)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Switch:
    """One step that moved memory: ``start``, ``wake``, ``park`` or ``stop``."""

    at: float  # when it began
    seconds: float
    kind: str
    mode: str  # ram | deep for parks and wakes
    model: str
    host: str
    pools: tuple[str, ...]
    cause: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.mode}" if self.mode else self.kind


@dataclass
class AdapterLoad:
    """An adapter loaded into an engine of its base (``engine``: NAME, or NAME~N for
    another replica), and those unloaded to make room for it first."""

    at: float  # when it began
    seconds: float
    adapter: str
    engine: str
    unloaded: tuple[str, ...] = ()


@dataclass
class Served:
    """One request's outcome."""

    at: float
    model: str
    status: int
    code: str | None
    waited: float  # seconds queued before the engine had it (for a refusal: until refused)
    ended: float = 0.0
    replica: str = ""  # the engine that served it: NAME, or NAME~N for another replica


@dataclass
class Hold:
    """A model's time on a pool: ``phase`` ``load`` (starting, waking), ``serve`` (ready,
    draining) or ``park`` (parking)."""

    model: str
    host: str
    pool: str
    begin: float
    end: float
    phase: str


@dataclass
class Scaled:
    """One scaling step of a model of several replicas (a ``deployment.scaled`` event):
    ``action`` ``wake`` or ``start`` (one more replica up) or ``park`` (one fewer);
    ``done``: whether it happened (a replica brought up is ready at its end; one that
    found no room, or no time within ``max_queue_seconds``, was not)."""

    at: float
    model: str
    replica: str  # its name: NAME for the first, NAME~N for the others
    action: str
    reason: str
    done: bool = True


@dataclass
class ReplicaSet:
    """A model of several replicas: ``minimum`` kept up while it serves, ``maximum`` at
    most, and the most that were up at once (ready or coming up)."""

    minimum: int
    maximum: int
    peak_up: int


@dataclass
class Outcome:
    scenario: str
    requests: list[Served] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    scaled: list[Scaled] = field(default_factory=list)
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)  # adapter -> its base
    adapters_unmeasured: list[str] = field(default_factory=list)  # loads of the default time
    replica_sets: dict[str, ReplicaSet] = field(default_factory=dict)  # by model
    waiting: list[tuple[float, int]] = field(default_factory=list)  # (time, requests queued)
    duration: float = 0.0  # virtual seconds replayed
    pools: dict[tuple[str, str], int] = field(default_factory=dict)  # (host, pool) -> capacity
    events: int = 0  # clock events handled
    plans: int = 0  # calls of the policy
    plans_saved: int = 0  # tries that found nothing changed since the last plan
    plan_seconds: float = 0.0  # wall time spent in them
    wall_seconds: float = 0.0
