"""What the placement policy (:mod:`capyctl.scheduler.policy`) decides on and answers:
plain data, no database, no clock. A host as the ledger sees it (:class:`HostSnapshot`:
its pools, the deployments holding memory there, those waiting for room), what a
deployment needs (:class:`Need`), and the answers (:class:`Placement` with its
:class:`Victim` list, or :class:`NoCapacity`). The policy module offers every name here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STOP = "stop"
RAM = "ram"
DEEP = "deep"

# When the measured residual of a parked engine is not known yet, assume this share of its
# claim stays on the GPU (CUDA context, graphs), at least MIN_RESIDUAL_BYTES.
RESIDUAL_SHARE = 0.1
MIN_RESIDUAL_BYTES = 512 * 1024**2
# Among contenders for the same GPUs, each point of priority counts as this much waiting.
TURN_PRIORITY_SECONDS = 10.0
# A model only batch requests wait for: its waiting counts for this share of an
# interactive one's; a model busy only with batch requests keeps its GPUs against an
# interactive one's wait for this share of its max_turn_seconds.
BATCH_SHARE = 0.25
# How a model's replicas are spread (Need.spread): over hosts first, or only over GPUs.
SPREAD_HOSTS = "hosts"
SPREAD_GPUS = "gpus"


@dataclass(frozen=True)
class Pool:
    """One pool as the ledger sees it: capacity and everything counted against it."""

    name: str
    capacity_bytes: int
    used_bytes: int  # held + promised + unconfirmed + foreign
    foreign_bytes: int = 0  # what no CapyCTL model holds: never freed by a switch

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


@dataclass(frozen=True)
class Resident:
    """A deployment that holds memory on a host now."""

    deployment_id: int
    name: str
    host_id: int
    state: str  # observed state
    gpu_bytes: dict[str, int]  # pool name -> bytes it holds there
    weights_bytes: int  # size of its weights copy
    residual_bytes: int | None  # measured residual after a park, if known
    park_policy: str  # auto | ram | deep | stop | never
    can_park_ram: bool
    can_park_deep: bool
    pinned: bool = False
    priority: int = 0
    last_used: float = 0.0  # seconds; larger is more recent
    ready_for_seconds: float = 0.0
    min_ready_seconds: float = 0.0
    ram_bytes: int = 0  # what it holds in host RAM (a parked copy, its engine)
    busy: bool = False  # requests in flight, or one ended a moment ago
    max_turn_seconds: float = 0.0  # how long it keeps its memory busy while others wait
    # Its engine's last park answered but left the GPU memory held: it is stopped instead.
    parks_unverified: bool = False
    # Why it may not park deep though its engine can ("": it may): its engine's releases
    # fail to wake from one with its adapter slots (LoRA enabled).
    deep_refused: str = ""
    # Busy with batch requests only (the classes of its requests known, no interactive one
    # waiting for it or in flight on it): an interactive need ends its turn sooner.
    batch: bool = False


@dataclass(frozen=True)
class Contender:
    """A deployment waiting for room on a host now, and for how long it has waited."""

    deployment_id: int
    name: str
    waited_seconds: float
    priority: int = 0
    pools: tuple[str, ...] = ()  # the GPU pools it waits for; () = any of the host's
    claim_per_gpu_bytes: int = 0  # what it needs on each of them; 0 = not known
    batch: bool = False  # only batch requests wait for it

    @property
    def standing(self) -> float:
        return standing(self.waited_seconds, self.priority, self.batch)

    def goes_before(self, deployment_id: int, standing: float) -> bool:
        """Whether it goes before a deployment of that standing (ties: the older one)."""
        return (self.standing, -self.deployment_id) > (standing, -deployment_id)


def is_gpu_pool(pool: str) -> bool:
    """Whether a ledger pool is GPU memory (``gpu0``, ``gpu1``, ..., or a unified host's
    one pool), not host RAM or disk."""
    return pool == "unified" or (pool.startswith("gpu") and pool[3:].isdigit())


def standing(waited_seconds: float, priority: int, batch: bool = False) -> float:
    """Who goes first among contenders: the longest wait (a batch-only wait counted for
    :data:`BATCH_SHARE` of its seconds), each point of priority counted as
    :data:`TURN_PRIORITY_SECONDS` of it."""
    return waited_seconds * (BATCH_SHARE if batch else 1.0) + TURN_PRIORITY_SECONDS * priority


@dataclass(frozen=True)
class HostSnapshot:
    host_id: int
    name: str
    unified: bool
    pools: dict[str, Pool]
    residents: list[Resident] = field(default_factory=list)
    online: bool = True
    contenders: tuple[Contender, ...] = ()  # deployments waiting for room here now

    @property
    def gpu_pools(self) -> list[str]:
        if self.unified:
            return ["unified"]
        return sorted((p for p in self.pools if is_gpu_pool(p)), key=lambda p: int(p[3:]))

    @property
    def ram_pool(self) -> str:
        return "unified" if self.unified else "ram"


@dataclass(frozen=True)
class Need:
    """What a deployment needs to start or wake."""

    deployment_id: int
    name: str
    gpus: int
    claim_per_gpu_bytes: int
    host_ram_bytes: int = 0  # the engine process, plus a weights copy it brings back
    host_ids: tuple[int, ...] | None = None  # where it may run; None = any host
    waited_seconds: float = 0.0  # how long it has waited for room so far
    priority: int = 0
    # The deployment ids of the same model's other replicas: never on the same GPU pool,
    # never evicted for this one.
    siblings: frozenset[int] = frozenset()
    spread: str = SPREAD_HOSTS  # "hosts": fewer siblings on a host first; "gpus": no host order
    batch: bool = False  # only batch requests wait for it (none interactive)

    def __post_init__(self) -> None:
        if self.spread not in (SPREAD_HOSTS, SPREAD_GPUS):
            raise ValueError(
                f"spread must be {SPREAD_HOSTS!r} or {SPREAD_GPUS!r}, not {self.spread!r}"
            )

    @property
    def standing(self) -> float:
        return standing(self.waited_seconds, self.priority, self.batch)


@dataclass(frozen=True)
class Victim:
    deployment_id: int
    name: str
    mode: str  # ram | deep | stop
    frees: dict[str, int]  # pool -> bytes it is expected to give back
    ram_copy_bytes: int  # what a ram park adds to the RAM pool
    reason: str  # why this mode: said in events and logs
    turn_over: bool = False  # busy, it had its turn: others waited its max_turn_seconds


@dataclass(frozen=True)
class Placement:
    host_id: int
    pools: tuple[str, ...]  # the GPU pools (or ("unified",), or () for a CPU deployment)
    victims: tuple[Victim, ...] = ()

    @property
    def gpu_indices(self) -> list[int]:
        if self.pools == ("unified",):
            return [0]  # a unified machine's one GPU
        return [int(p[3:]) for p in self.pools if p.startswith("gpu")]


@dataclass(frozen=True)
class NoCapacity:
    """It does not fit now even with everything parkable parked; ``blockers`` are in the
    way. ``lasting``: it would not fit even with every model that is not pinned parked or
    stopped, so waiting cannot help; else what is in the way will pass (a model starting,
    waking or draining, one inside its ``min_ready_seconds``, memory not yet confirmed
    free) and the request waits for it."""

    reason: str
    blockers: tuple[str, ...] = ()
    lasting: bool = True
    pools: tuple[str, ...] = ()  # where it waits for room (not lasting); () = unknown
