"""The replay: a trace's requests against a scenario, on a virtual clock.

What is simulated is the clock and the engines (a start, park or wake takes the model's
timing; a request takes its service time; memory is what the ledger would count). What is
decided is decided by production's code: every placement, every choice of victims and of
their park mode, and every turn comes from :func:`capyctl.scheduler.policy.plan` on a
:class:`~capyctl.scheduler.policy.HostSnapshot` built the way
:mod:`capyctl.scheduler.snapshots` builds it from the ledger. The loop around it follows
:func:`capyctl.scheduler.operations.ensure_ready` step by step:

- a request for a ready model is served at once; one for another model joins that model's
  queue (refused ``queue_full`` past ``max_waiting``), and one wake runs per model,
  however many requests wait for it; every request that waits shares its outcome;
- a wake tries (start a stopped model, wake a parked one, evicting the victims the plan
  names, each drained of its requests first, then parked or stopped, up to
  :data:`~capyctl.scheduler.operations.MAX_SWITCH_ROUNDS` rounds); when what is in the way
  passes it notes its wait for room (what turns are decided on) and tries again after
  :data:`~capyctl.scheduler.snapshots.BUSY_GRACE_SECONDS`, then every
  :data:`~capyctl.scheduler.operations.ROOM_RETRY_SECONDS`, until ``max_queue_seconds``
  (refused ``wake_timeout``); a plan that cannot fit even with everything parked refuses
  at once (``no_capacity``);
- a reconcile pass every :data:`~capyctl.scheduler.executor.RECONCILE_SECONDS` parks models
  idle for their ``idle_park_seconds``.

Not simulated: engines that fail, parks that keep their memory, clients that leave, the
per-key fairness inside one model's queue, drain timeouts (a drain waits for its requests).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from capyctl.scheduler.policy import (
    DEEP,
    RAM,
    STOP,
    Contender,
    HostSnapshot,
    Need,
    NoCapacity,
    Placement,
    Pool,
    Resident,
    Victim,
    expected_residual,
    park_mode,
    plan,
    turn_left,
)
from capyctl.whatif.model import Request, Scenario, SimHost, SimModel

# The production loop's constants (read once: importing them needs Django's settings).
_constants: dict[str, float] = {}


def _constant(name: str) -> float:
    if not _constants:
        from capyctl.scheduler import executor, operations, snapshots  # noqa: PLC0415 - Django set up by then
        from capyctl.scheduler.estimates import ENGINE_RAM_ESTIMATE  # noqa: PLC0415

        _constants.update(
            busy_grace=snapshots.BUSY_GRACE_SECONDS,
            room_retry=operations.ROOM_RETRY_SECONDS,
            rounds=operations.MAX_SWITCH_ROUNDS,
            reconcile=executor.RECONCILE_SECONDS,
            engine_ram=ENGINE_RAM_ESTIMATE,
        )
    return _constants[name]


_FIRST_TRY_SECONDS = 0.05  # a try that found nothing in the way, waiting on a switch


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
class Served:
    """One request's outcome."""

    at: float
    model: str
    status: int
    code: str | None
    waited: float  # seconds queued before the engine had it (for a refusal: until refused)
    ended: float = 0.0


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
class Outcome:
    scenario: str
    requests: list[Served] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    waiting: list[tuple[float, int]] = field(default_factory=list)  # (time, requests queued)
    duration: float = 0.0  # virtual seconds replayed
    pools: dict[tuple[str, str], int] = field(default_factory=dict)  # (host, pool) -> capacity
    events: int = 0  # clock events handled
    plans: int = 0  # calls of the policy
    plans_saved: int = 0  # tries that found nothing changed since the last plan
    plan_seconds: float = 0.0  # wall time spent in them
    wall_seconds: float = 0.0


class _Signal:
    """Something a process waits for (a drain's end, a change of state); fired each time
    it happens."""

    def __init__(self) -> None:
        self.waiters: list[Callable[[], None]] = []


@dataclass(frozen=True)
class _Until:
    """Wait for ``signal``, or ``seconds`` at most (whichever comes first)."""

    signal: _Signal
    seconds: float


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


class Replay:
    """One run of a trace against a scenario."""

    def __init__(
        self, scenario: Scenario, requests: Iterable[Request], *, every_try: bool = False
    ) -> None:
        """``every_try``: plan at every try for room, as the server does, instead of only
        when something the plan decides on may have changed (the same answers, slower:
        tests check that they are the same)."""
        self.every_try = every_try
        self.scenario = scenario
        self.requests = list(requests)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.hosts = [_Host(i + 1, h) for i, h in enumerate(scenario.hosts)]
        self._host_by_name = {h.name: h for h in self.hosts}
        self.models = [_Model(i + 1, m) for i, m in enumerate(scenario.models)]
        self._by_name: dict[str, _Model] = {}
        for model in self.models:
            for name in (model.name, *model.spec.aliases):
                self._by_name.setdefault(name, model)
        self.out = Outcome(scenario.name)
        self.out.pools = {(h.name, p): c for h in self.hosts for p, c in h.capacity.items()
                          if p != "ram"}  # fmt: skip
        self._queued = 0
        self._memo: dict[tuple[int, int, bool], tuple[tuple[Any, ...], Placement | NoCapacity]] = {}
        self._engine_ram = int(_constant("engine_ram"))
        self._place_initial()

    # -- the clock ------------------------------------------------------------------------

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), action))

    def _spawn(self, process: Generator[Any, Any, None]) -> None:
        self._step(process)

    def _step(self, process: Generator[Any, Any, None]) -> None:
        try:
            waits = next(process)
        except StopIteration:
            return
        if isinstance(waits, _Signal):
            waits.waiters.append(partial(self._step, process))
        elif isinstance(waits, _Until):
            resumed = [False]

            def resume() -> None:
                if not resumed[0]:
                    resumed[0] = True
                    self._step(process)

            waits.signal.waiters.append(resume)
            self._at(self.now + waits.seconds, resume)
        else:
            self._at(self.now + float(waits), partial(self._step, process))

    def _fire(self, signal: _Signal) -> None:
        waiters, signal.waiters = signal.waiters, []
        for resume in waiters:
            self._at(self.now, resume)

    def run(self) -> Outcome:
        began = time.perf_counter()
        for index, request in enumerate(self.requests):
            self._at(request.at, partial(self._arrive, request, index))
        self.out.requests = [Served(r.at, r.model, 0, None, 0.0) for r in self.requests]
        if any(m.spec.idle_park_seconds > 0 for m in self.models):
            self._at(0.0, self._reconcile)
        last_arrival = self.requests[-1].at if self.requests else 0.0
        while self._heap:
            when, _, action = heapq.heappop(self._heap)
            if when > last_arrival and self._idle():
                break  # nothing more to happen but reconcile passes
            self.now = when
            self.out.events += 1
            action()
        self.out.duration = max(self.now, last_arrival)
        for model in self.models:
            self._end_hold(model)
        self.out.wall_seconds = time.perf_counter() - began
        return self.out

    def _idle(self) -> bool:
        return self._queued == 0 and all(
            m.in_flight == 0 and not m.waking and not m.operating for m in self.models
        )

    # -- requests -------------------------------------------------------------------------

    def _arrive(self, request: Request, index: int) -> None:
        model = self._by_name.get(request.model)
        if model is None:
            self._answer(index, 404, "model_not_found", 0.0)
            return
        if model.spec.desired != "running":
            self._answer(index, 503, "model_stopped", 0.0)
            return
        if model.state == "ready":
            self._serve(model, request, index)
            return
        if len(model.queue) >= model.spec.max_waiting:
            self._answer(index, 429, "queue_full", 0.0)
            return
        model.queue.append((request, index))
        self._queued += 1
        self._note_waiting()
        if not model.waking:
            model.waking = True
            self._spawn(self._ensure_ready(model))

    def _serve(self, model: _Model, request: Request, index: int) -> None:
        if model.host is not None:
            self._fire(model.host.changed)
        model.in_flight += 1
        model.last_used = self.now
        served = self.out.requests[index]
        served.status, served.waited = 200, self.now - request.at
        service = request.service if request.service is not None else model.spec.timings.service
        served.ended = self.now + service
        self._at(served.ended, partial(self._done, model))

    def _done(self, model: _Model) -> None:
        if model.host is not None:
            self._fire(model.host.changed)
        model.in_flight -= 1
        model.last_used = model.last_end = self.now
        if model.in_flight == 0:
            self._fire(model.drained)

    def _answer(self, index: int, status: int, code: str | None, waited: float) -> None:
        served = self.out.requests[index]
        served.status, served.code, served.waited, served.ended = status, code, waited, self.now

    def _release_queue(self, model: _Model, code: str | None, status: int = 200) -> None:
        waiting, model.queue = model.queue, []
        self._queued -= len(waiting)
        for request, index in waiting:
            if code is None:
                self._serve(model, request, index)
            else:
                self._answer(index, status, code, self.now - request.at)
        self._note_waiting()

    def _note_waiting(self) -> None:
        waits = self.out.waiting
        if waits and waits[-1][0] == self.now:
            waits[-1] = (self.now, self._queued)
        else:
            waits.append((self.now, self._queued))

    # -- the ledger, as snapshots.py reads it ----------------------------------------------

    def _used(self, host: _Host) -> dict[str, int]:
        used = dict.fromkeys(host.capacity, 0)
        for pool, num in host.spec.foreign.items():
            if pool in used:
                used[pool] += num
        for model in host.models.values():
            for pool, num in model.entries.items():
                used[pool] = used.get(pool, 0) + num
        return used

    def _busy(self, model: _Model) -> bool:
        if model.in_flight > 0:
            return True
        return model.last_end is not None and self.now - model.last_end < _constant("busy_grace")

    def _snapshot(self, host: _Host, leave_out: int | None = None) -> HostSnapshot:
        used = self._used(host)
        pools = {p: Pool(p, cap, used[p], host.spec.foreign.get(p, 0))
                 for p, cap in host.capacity.items()}  # fmt: skip
        residents = []
        for model in host.models.values():
            if model.id == leave_out:
                continue
            spec = model.spec
            gpu = {p: b for p, b in model.entries.items() if p not in ("ram",)}
            if host.spec.unified:
                gpu = dict(model.entries)
            residents.append(
                Resident(
                    deployment_id=model.id,
                    name=model.name,
                    host_id=host.id,
                    state=model.state,
                    gpu_bytes=gpu,
                    weights_bytes=spec.weights_bytes,
                    residual_bytes=None,
                    park_policy=spec.park,
                    can_park_ram=spec.can_park_ram,
                    can_park_deep=spec.can_park_deep,
                    pinned=spec.pinned,
                    priority=spec.priority,
                    last_used=model.last_used or model.changed_at,
                    ready_for_seconds=self.now - model.changed_at,
                    min_ready_seconds=spec.min_ready_seconds,
                    ram_bytes=model.entries.get("ram", 0),
                    busy=model.state == "ready" and self._busy(model),
                    max_turn_seconds=spec.max_turn_seconds,
                )
            )
        contenders = tuple(
            Contender(m.id, m.name, self.now - m.wait_since, m.spec.priority, m.wait_pools)
            for m in host.waiters.values()
            if m.wait_since is not None
        )
        return HostSnapshot(host.id, host.name, host.spec.unified, pools, residents,
                            host.spec.online, contenders)  # fmt: skip

    def _plan(self, snapshots: list[HostSnapshot], need: Need) -> Placement | NoCapacity:
        began = time.perf_counter()
        try:
            return plan(snapshots, need)
        finally:
            self.out.plans += 1
            self.out.plan_seconds += time.perf_counter() - began

    def _plan_on(
        self, host: _Host, model: _Model, need: Need, *, waking: bool = False
    ) -> Placement | NoCapacity:
        """:func:`plan` for ``model`` on ``host``, or its answer of the last try when
        nothing it decides on has changed since: the ledger and the states on the host
        (its version), the order of its residents, and what time changes of them (a
        model's min_ready_seconds over, a busy model's turn over, a model no longer busy).
        A wait for room tries four times a second; most tries find the same host."""
        key = self._decides_on(host, model, need)
        memo = self._memo.get((model.id, host.id, waking))
        if memo is not None and memo[0] == key and not self.every_try:
            self.out.plans_saved += 1
            return memo[1]
        if waking:
            snap = self._snapshot(host, leave_out=model.id)
            pools = model.pools
            snap = HostSnapshot(snap.host_id, snap.name, snap.unified,
                                {p: snap.pools[p] for p in (*pools, _ram(host)) if p in snap.pools},
                                snap.residents, contenders=snap.contenders)  # fmt: skip
        else:
            snap = self._snapshot(host)
        result = self._plan([snap], need)
        self._memo[(model.id, host.id, waking)] = (key, result)
        return result

    def _decides_on(self, host: _Host, model: _Model, need: Need) -> tuple[Any, ...]:
        residents = []
        for other in host.models.values():
            if other is model:
                continue
            busy = other.state == "ready" and self._busy(other)
            ready_for = self.now - other.changed_at
            spec = other.spec
            residents.append((
                spec.priority, other.last_used or other.changed_at, other.id, busy,
                ready_for >= spec.min_ready_seconds,
                turn_left(busy, spec.max_turn_seconds, need.waited_seconds, ready_for) > 0,
            ))  # fmt: skip
        residents.sort()
        order = tuple(r[2:] for r in residents)
        return (host.version, need.claim_per_gpu_bytes, order)

    def _need(self, model: _Model, host: _Host, claim: int | None = None) -> Need:
        return Need(model.id, model.name, model.spec.gpus,
                    model.spec.claim_bytes if claim is None else claim,
                    self._engine_ram if claim is None else 0, (host.id,),
                    self.now - model.wait_since if model.wait_since is not None else 0.0,
                    model.spec.priority)  # fmt: skip

    # -- state changes ----------------------------------------------------------------------

    def _move(self, model: _Model, state: str) -> None:
        if model.host is not None:
            self._bump(model.host)
        self._fire(model.changed)
        if _phase(model.state) != _phase(state):
            self._end_hold(model)  # the time it spent in its phase so far, on its pools
            model.phase_since = self.now
        model.state = state
        model.changed_at = self.now

    def _bump(self, host: _Host) -> None:
        host.version += 1
        self._fire(host.changed)

    def _end_hold(self, model: _Model) -> None:
        phase = _phase(model.state)
        if phase is None or model.host is None or self.now <= model.phase_since:
            return
        for pool in model.pools or ():
            self.out.holds.append(
                Hold(model.name, model.host.name, pool, model.phase_since, self.now, phase)
            )
        model.phase_since = self.now

    def _switch(self, model: _Model, kind: str, mode: str, seconds: float, cause: str) -> None:
        host = model.host.name if model.host else ""
        self.out.switches.append(
            Switch(self.now, seconds, kind, mode, model.name, host, tuple(model.pools), cause)
        )

    def _place_initial(self) -> None:
        """Models that hold memory when the replay begins (ready or parked), on their pools."""
        for model in self.models:
            host = self._host_by_name.get(model.spec.host or "")
            if model.state not in ("ready", "parked") or host is None:
                model.state, model.sleep_mode, model.pools = "stopped", "", ()
                if host is not None:
                    model.host = host
                continue
            pools = tuple(p for p in model.pools if p in host.capacity)
            if not pools and model.spec.gpus:
                model.state, model.pools = "stopped", ()
                model.host = host
                continue
            model.host, model.pools = host, pools
            host.models[model.id] = model
            claim = model.spec.claim_bytes
            if model.state == "ready":
                model.entries = {**dict.fromkeys(pools, claim), "ram": self._engine_ram}
            else:
                copy = model.spec.weights_bytes if model.sleep_mode == RAM else 0
                model.entries = {**{p: model.residual(claim) for p in pools},
                                 "ram": self._engine_ram + copy}  # fmt: skip
            model.changed_at = -max(model.spec.min_ready_seconds, 0.0) - 1.0
            model.phase_since = 0.0

    # -- ensure_ready ----------------------------------------------------------------------

    def _ensure_ready(self, model: _Model) -> Generator[Any, Any, None]:
        deadline = self.now + model.spec.max_queue_seconds
        no_room: NoCapacity | None = None
        tries = 0
        try:
            while True:
                if model.state == "ready":
                    self._release_queue(model, None)
                    return
                if not model.operating:
                    outcome = yield from self._try_once(model)
                    if isinstance(outcome, NoCapacity) and outcome.lasting:
                        self._release_queue(model, "no_capacity", 503)
                        return
                    no_room = outcome
                    tries = tries + 1 if no_room is not None else 0
                    if model.state == "ready":
                        self._release_queue(model, None)
                        return
                if self.now >= deadline:
                    self._release_queue(model, "wake_timeout", 504)
                    return
                if no_room is None:
                    yield from self._until_switch_ends(model, deadline)
                else:
                    yield from self._until_room_may_change(model, tries, deadline)
                if no_room is not None and not model.queue:
                    return  # nobody waits for it any more
        finally:
            model.waking = False
            if model.wait_host is not None:
                model.wait_host.waiters.pop(model.id, None)
                self._bump(model.wait_host)
            model.wait_since, model.wait_host, model.wait_pools = None, None, ()

    def _until_switch_ends(self, model: _Model, deadline: float) -> Generator[Any, Any, None]:
        """Nothing to try until its own switch ends (it starts, wakes, drains or parks): the
        loop polls every 0.05 s; it is woken at the first poll after the change, or at the
        deadline's."""
        if self.every_try:
            yield _FIRST_TRY_SECONDS
            return
        began = self.now
        left = max(deadline - began, 0.0)
        yield _Until(
            model.changed, math.ceil(left / _FIRST_TRY_SECONDS + 1e-9) * _FIRST_TRY_SECONDS
        )
        ticks = max(math.ceil((self.now - began) / _FIRST_TRY_SECONDS - 1e-9), 1)
        rest = began + ticks * _FIRST_TRY_SECONDS - self.now
        if rest > 1e-9:
            yield rest

    def _until_room_may_change(
        self, model: _Model, tries: int, deadline: float
    ) -> Generator[Any, Any, None]:
        """Wait as the loop does between tries for room (after 0.1 s, then every 0.25 s),
        skipping the tries that would find the same host: it wakes at the first try after
        anything the plan decides on may have changed (a change of state or of a request on
        the host, a min_ready_seconds or turn running out, a model no longer busy), or at
        its deadline. A skipped try is one the plan would have answered as before."""
        first = _constant("room_retry") if tries > 1 else _constant("busy_grace")
        step = _constant("room_retry")
        host = model.wait_host
        began = self.now
        if host is None or (model.host is None and len(self.hosts) > 1) or self.every_try:
            yield first  # not on one host yet: every host may change, so every try runs
            return
        horizon = min(self._horizon(host, model), deadline)
        wait = max(horizon - began, first)
        ticks = math.ceil((wait - first) / step - 1e-9)
        yield _Until(host.changed, first + max(ticks, 0) * step)
        waited = self.now - began
        if waited < first - 1e-9:
            yield first - waited
            return
        ticks = math.ceil((waited - first) / step - 1e-9)
        rest = first + ticks * step - waited
        if rest > 1e-9:
            yield rest

    def _horizon(self, host: _Host, model: _Model) -> float:
        """The first moment at which time alone changes something the plan decides on."""
        soonest = math.inf
        since = model.wait_since if model.wait_since is not None else self.now
        grace = _constant("busy_grace")
        for other in host.models.values():
            if other is model:
                continue
            spec = other.spec
            mature = other.changed_at + spec.min_ready_seconds
            if mature > self.now:
                soonest = min(soonest, mature)
            if other.in_flight == 0 and other.last_end is not None:
                idle = other.last_end + grace
                if idle > self.now:
                    soonest = min(soonest, idle)
            turn_over = max(since, other.changed_at) + spec.max_turn_seconds
            if turn_over > self.now:
                soonest = min(soonest, turn_over)
        return soonest

    def _try_once(self, model: _Model) -> Generator[Any, Any, NoCapacity | None]:
        if model.state == "stopped":
            return (yield from self._start(model))
        if model.state == "parked":
            return (yield from self._wake(model))
        return None  # starting, waking, draining, parking or stopping: it passes

    def _refused(self, model: _Model, host: _Host, result: NoCapacity,
                 pools: tuple[str, ...] = ()) -> NoCapacity:  # fmt: skip
        if not result.lasting:  # noted as turns.note does: a wait kept on the same host
            if model.wait_since is None or model.wait_host is not host:
                if model.wait_host is not None:
                    model.wait_host.waiters.pop(model.id, None)
                    self._bump(model.wait_host)
                model.wait_since = self.now
            wait_pools = tuple(result.pools or pools)
            if model.wait_host is not host or model.wait_pools != wait_pools:
                self._bump(host)
            model.wait_host, model.wait_pools = host, wait_pools
            host.waiters[model.id] = model
        return result

    def _source_host(self, model: _Model) -> _Host | None:
        if model.host is not None:
            return model.host
        for host in self.hosts:
            result = self._plan_on(host, model, self._need(model, host))
            if not isinstance(result, NoCapacity):
                return host
        return self.hosts[0] if self.hosts else None

    def _start(self, model: _Model) -> Generator[Any, Any, NoCapacity | None]:
        host = self._source_host(model)
        if host is None:
            return NoCapacity(f"no host can run {model.name}: there are no hosts")
        for _round in range(int(_constant("rounds"))):
            need = self._need(model, host)
            result = self._plan_on(host, model, need)
            if isinstance(result, NoCapacity):
                return self._refused(model, host, result)
            if result.victims:
                for victim in result.victims:
                    yield from self._evict(victim, model)
                if model.state != "stopped":
                    return None
                continue
            pools = _pool_names(host, result)
            model.host, model.pools = host, pools
            host.models[model.id] = model
            model.entries = dict.fromkeys(pools, need.claim_per_gpu_bytes)
            ram = "unified" if host.spec.unified else "ram"
            model.entries[ram] = model.entries.get(ram, 0) + need.host_ram_bytes
            seconds = model.spec.timings.start
            self._switch(model, "start", "", seconds, "a request")
            self._move(model, "starting")
            yield seconds
            model.entries = dict.fromkeys(pools, need.claim_per_gpu_bytes)
            if not host.spec.unified:
                model.entries["ram"] = self._engine_ram
            else:
                model.entries["unified"] = model.entries.get("unified", 0) + self._engine_ram
            self._move(model, "ready")
            return None
        return NoCapacity(f"{model.name}: memory was not freed", lasting=False)

    def _wake(self, model: _Model) -> Generator[Any, Any, NoCapacity | None]:
        host = model.host
        if host is None:
            return (yield from self._start(model))
        claim = model.spec.claim_bytes
        pools = model.pools
        for _round in range(int(_constant("rounds"))):
            used = self._used(host)
            mine = model.entries
            if all(host.capacity[p] - used[p] + mine.get(p, 0) >= claim for p in pools):
                break
            residual = min((mine.get(p, 0) for p in pools), default=0)
            need = self._need(model, host, claim - residual)
            result = self._plan_on(host, model, need, waking=True)
            if isinstance(result, NoCapacity):
                return self._refused(model, host, result, pools)
            for victim in result.victims:
                yield from self._evict(victim, model)
            if model.state != "parked":
                return None
        else:
            return NoCapacity(f"{model.name}: memory was not freed", lasting=False)
        mode = model.sleep_mode or RAM
        for pool in pools:
            model.entries[pool] = claim
        seconds = model.spec.timings.wake(mode)
        self._switch(model, "wake", mode, seconds, "a request")
        self._move(model, "waking")
        yield seconds
        model.entries = {**dict.fromkeys(pools, claim), _ram(host): self._engine_ram}
        if host.spec.unified:
            model.entries = {"unified": claim + self._engine_ram}
        model.sleep_mode = ""
        self._move(model, "ready")
        return None

    # -- making room ----------------------------------------------------------------------

    def _evict(self, victim: Victim, for_model: _Model) -> Generator[Any, Any, None]:
        model = self.models[victim.deployment_id - 1]
        cause = f"to make room for {for_model.name}" + (", its turn over" if victim.turn_over
                                                          else "")  # fmt: skip
        if model.state == "parked" and victim.mode == STOP:
            yield from self._stop(model, f"{victim.reason} ({for_model.name})")
            return
        if model.state != "ready" or model.operating:
            return
        yield from self._park(model, victim.mode, cause)

    def _park(self, model: _Model, mode: str, cause: str) -> Generator[Any, Any, None]:
        host = model.host
        if host is None:  # only a model placed on a host is ever ready
            return
        model.operating = True
        try:
            self._move(model, "draining")
            if model.in_flight:
                yield model.drained
            if mode == STOP:
                yield from self._stop(model, cause)
                return
            if mode == RAM and not host.spec.unified:
                used = self._used(host)
                if host.capacity["ram"] - used["ram"] >= model.spec.weights_bytes:
                    model.entries["ram"] = model.entries.get("ram", 0) + model.spec.weights_bytes
                else:
                    mode = DEEP  # its copy no longer fits in host RAM
            seconds = model.spec.timings.park(mode)
            self._switch(model, "park", mode, seconds, cause)
            self._move(model, "parking")
            yield seconds
            for pool in model.pools:
                model.entries[pool] = model.residual(model.entries.get(pool, 0))
            model.sleep_mode = mode
            self._move(model, "parked")
        finally:
            model.operating = False
            self._fire(model.changed)

    def _stop(self, model: _Model, cause: str) -> Generator[Any, Any, None]:
        seconds = model.spec.timings.stop
        self._switch(model, "stop", "", seconds, cause)
        self._move(model, "stopping")
        yield seconds
        if model.host is not None:
            model.host.models.pop(model.id, None)
        model.entries = {}
        model.sleep_mode = ""
        self._move(model, "stopped")

    # -- reconcile: idle parks -------------------------------------------------------------

    def _reconcile(self) -> None:
        for model in self.models:
            idle = model.spec.idle_park_seconds
            last = max(model.last_end or 0.0, model.changed_at)
            if (
                idle > 0
                and model.state == "ready"
                and not model.spec.pinned
                and not model.operating
                and model.in_flight == 0
                and self.now - last >= idle
            ):
                self._spawn(self._idle_park(model, idle))
        self._at(self.now + _constant("reconcile"), self._reconcile)

    def _idle_park(self, model: _Model, idle: float) -> Generator[Any, Any, None]:
        host = model.host
        if host is None:
            return
        snap = self._snapshot(host)
        resident = next(r for r in snap.residents if r.deployment_id == model.id)
        ram_free = snap.pools[snap.ram_pool].free_bytes if snap.ram_pool in snap.pools else 0
        mode, _why = park_mode(resident, snap, ram_free)
        yield from self._park(model, mode, f"after {idle:g}s idle")


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


def replay(scenario: Scenario, requests: Iterable[Request], *, every_try: bool = False) -> Outcome:
    """Replay ``requests`` (sorted by arrival) against ``scenario``."""
    return Replay(scenario, sorted(requests, key=lambda r: r.at), every_try=every_try).run()


__all__ = ["Hold", "Outcome", "Replay", "Served", "SimHost", "SimModel", "Switch", "replay"]
