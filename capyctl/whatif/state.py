"""The replay's models and hosts, as the ledger and the gateway would see them, with the
server's constants the replay's world follows (the step's own are in
:mod:`capyctl.scheduler.steps`)."""

from __future__ import annotations

import math
from collections import deque

from capyctl.scheduler.policy import Placement, Resident, expected_residual
from capyctl.whatif.clock import _Signal
from capyctl.whatif.model import Request, SimHost, SimModel, SimReplica
from capyctl.whatif.outcome import Scaled

# The server's constants (read once: importing them needs Django's settings).
_constants: dict[str, float] = {}


def _constant(name: str) -> float:
    if not _constants:
        from capyctl.scheduler import executor  # noqa: PLC0415 - Django set up by then
        from capyctl.scheduler.estimates import ENGINE_RAM_ESTIMATE  # noqa: PLC0415

        _constants.update(reconcile=executor.RECONCILE_SECONDS, engine_ram=ENGINE_RAM_ESTIMATE)
    return _constants[name]


class _Model:
    """A model's state as the ledger and the gateway would see it: one engine, so one of
    a model's replicas (``replica`` 0, the first, is the deployment itself; replica N is
    named ``NAME~N``, as the server names its row)."""

    def __init__(
        self, index: int, spec: SimModel, replica: int = 0, start: SimReplica | None = None
    ) -> None:
        self.id = index
        self.spec = spec
        self.served = spec.name  # the name its requests and the report use
        self.name = spec.name if replica == 0 else f"{spec.name}~{replica}"
        if start is None:
            start = SimReplica(spec.host, spec.state, spec.parked_mode, list(spec.pools))
        self.home = start.host  # its host's name at the start (None: placed where it fits)
        self.state = start.state if spec.desired == "running" else "stopped"
        self.sleep_mode = start.parked_mode  # ram | deep, when parked
        # What its last park left on a GPU (counted on when it is parked again).
        self.left_parked: int | None = spec.measured_residual_bytes
        self.host: _Host | None = None
        self.pools: tuple[str, ...] = tuple(start.pools)
        self.entries: dict[str, int] = {}  # pool -> bytes, on its host
        self.changed_at = 0.0
        self.last_used = 0.0
        self.last_end: float | None = None
        self.in_flight = 0  # requests sent to its engine, served or waiting in it
        self.batch_in_flight = 0  # those of them of batch keys
        self.last_batch = False  # the request that ended last was a batch key's
        self.running = 0  # those its engine works on (max_concurrency at most)
        self.backlog: deque[tuple[Request, int]] = deque()  # those waiting in its engine
        self.queue: list[tuple[Request, int]] = []  # waiting requests, with their index
        self.waking = False  # a wake loop runs for it
        self.scale_up: Scaled | None = None  # the scale-up that brings it up, if one does
        self.group: _Group | None = None  # its model's replicas, when it has several
        self.siblings: frozenset[int] = frozenset()  # their ids, its own left out
        self.drained = _Signal()
        self.changed = _Signal()  # its state changed, or an operation on it ended
        self.operating = False  # an eviction or an idle park has it
        # Its wait for room (what turns are decided on): since when, on which host and pools.
        self.wait_since: float | None = None
        self.wait_host: _Host | None = None
        self.wait_pools: tuple[str, ...] = ()
        self.wait_claim = 0  # what it waits to take on each of those pools
        self.phase_since = 0.0
        # Its engine's adapters (capyctl.whatif.adapters): those it holds, each with when
        # it was last used and loaded (the least recently used order); the loads asked of
        # it, each with the requests waiting for it; and whether a load or unload of it
        # runs (one at a time, as the server's lock per engine has them).
        self.adapters: dict[str, tuple[float, float]] = {}
        self.loads: dict[str, list[tuple[Request, int]]] = {}
        self.loading = False
        self.load_turn = _Signal()  # a load of its engine ended

    def residual(self, held: int) -> int:
        """What a park leaves on a GPU where it held ``held``: as the scenario sets it, else
        as its parks on the server left, else the policy's guess."""
        known = self.spec.residual_bytes
        if known is None:
            known = self.spec.measured_residual_bytes
        if known is not None:
            return min(known, held)
        return expected_residual(_bare_resident(self, held), held)


class _Group:
    """A model of several replicas: its replicas (the first first) and what its scaling
    decisions read: the figures of the gateway's model route and of the scheduler's pass,
    the requests sent to its engines whose answer has not begun, and the scale-up under
    way."""

    def __init__(self, replicas: list[_Model]) -> None:
        spec = replicas[0].spec
        self.name = spec.name
        self.replicas = replicas
        self.kept_up = spec.kept_up
        self.target_concurrency = spec.target_concurrency
        self.scale_up_wait_seconds = spec.scale_up_wait_seconds or math.inf
        self.idle_park_seconds = spec.idle_park_seconds or math.inf
        # Requests sent to an engine of it and waiting there: how many, and a heap of
        # (arrival, index) whose ended entries are dropped as they come to its top.
        self.waiting = 0
        self.waiting_since: list[tuple[float, int]] = []
        self.bringing: _Model | None = None  # the gateway's scale-up under way
        self.peak_up = 0
        # What the scheduler's pass decides on changes with ``version`` (a replica's state
        # or requests in flight), or with time once an idle replica may be parked: until
        # ``quiet_until``, a pass that found nothing to do at ``version`` finds the same.
        self.version = 0
        self.quiet_version = -1
        self.quiet_until = 0.0


def _bare_resident(model: _Model, held: int) -> Resident:
    return Resident(model.id, model.name, 0, model.state, {"gpu0": held}, 0, None, "auto",
                    False, False)  # fmt: skip


class _Host:
    def __init__(self, index: int, spec: SimHost) -> None:
        self.id = index
        self.spec = spec
        self.name = spec.name
        self.capacity = spec.pools
        self.models: dict[int, _Model] = {}  # those with ledger entries here
        self.waiters: dict[int, _Model] = {}  # those waiting for room here (turns)
        self.version = 0  # bumped at every change of state of a model here
        self.changed = _Signal()  # that, or a request begun or ended on a model here


def _phase(state: str) -> str | None:
    if state in ("starting", "waking"):
        return "load"
    if state in ("ready", "draining"):
        return "serve"
    if state in ("parking", "stopping"):
        return "park"
    return None


def _ram(host: _Host) -> str:
    return "unified" if host.spec.unified else "ram"


def _pool_names(host: _Host, placement: Placement) -> tuple[str, ...]:
    if host.spec.unified:
        return ("unified",) if placement.pools else ()
    return tuple(placement.pools)
