"""The replay's models and hosts, as the ledger and the gateway would see them, with the
server's constants the replay's world follows (the step's own are in
:mod:`capyctl.scheduler.steps`)."""

from __future__ import annotations

from capyctl.scheduler.policy import Placement, Resident, expected_residual
from capyctl.whatif.clock import _Signal
from capyctl.whatif.model import Request, SimHost, SimModel

# The server's constants (read once: importing them needs Django's settings).
_constants: dict[str, float] = {}


def _constant(name: str) -> float:
    if not _constants:
        from capyctl.scheduler import executor  # noqa: PLC0415 - Django set up by then
        from capyctl.scheduler.estimates import ENGINE_RAM_ESTIMATE  # noqa: PLC0415

        _constants.update(reconcile=executor.RECONCILE_SECONDS, engine_ram=ENGINE_RAM_ESTIMATE)
    return _constants[name]


class _Model:
    """A model's state as the ledger and the gateway would see it."""

    def __init__(self, index: int, spec: SimModel) -> None:
        self.id = index
        self.spec = spec
        self.name = spec.name
        self.state = spec.state if spec.desired == "running" else "stopped"
        self.sleep_mode = spec.parked_mode  # ram | deep, when parked
        self.host: _Host | None = None
        self.pools: tuple[str, ...] = tuple(spec.pools)
        self.entries: dict[str, int] = {}  # pool -> bytes, on its host
        self.changed_at = 0.0
        self.last_used = 0.0
        self.last_end: float | None = None
        self.in_flight = 0
        self.queue: list[tuple[Request, int]] = []  # waiting requests, with their index
        self.waking = False  # a wake loop runs for it
        self.drained = _Signal()
        self.changed = _Signal()  # its state changed, or an operation on it ended
        self.operating = False  # an eviction or an idle park has it
        # Its wait for room (what turns are decided on): since when, on which host and pools.
        self.wait_since: float | None = None
        self.wait_host: _Host | None = None
        self.wait_pools: tuple[str, ...] = ()
        self.wait_claim = 0  # what it waits to take on each of those pools
        self.phase_since = 0.0

    def residual(self, held: int) -> int:
        if self.spec.residual_bytes is not None:
            return min(self.spec.residual_bytes, held)
        return expected_residual(_bare_resident(self, held), held)


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
