"""The ledger as the replay keeps it: memory per pool, each model's state and its changes
(recorded as switches and holds), and the snapshots and plans built from it, as
:mod:`capyctl.scheduler.snapshots` builds them."""

from __future__ import annotations

import time
from typing import Any

from capyctl.scheduler import scaling, steps
from capyctl.scheduler.policy import (
    RAM,
    Contender,
    HostSnapshot,
    Need,
    NoCapacity,
    Placement,
    Pool,
    Resident,
    plan,
    turn_left,
)
from capyctl.whatif.clock import Clock
from capyctl.whatif.model import Request, Scenario
from capyctl.whatif.outcome import Hold, Outcome, Switch
from capyctl.whatif.state import _Group, _Host, _Model, _phase, _ram


class Ledger(Clock):
    """The replay's hosts and models (set up by :class:`~capyctl.whatif.engine.Replay`) and
    what the ledger reads and writes of them."""

    every_try: bool
    scenario: Scenario
    hosts: list[_Host]
    models: list[_Model]
    out: Outcome
    _host_by_name: dict[str, _Host]
    _memo: dict[tuple[int, int, bool], tuple[tuple[Any, ...], Placement | NoCapacity]]
    _engine_ram: int

    def _used(self, host: _Host) -> dict[str, int]:
        used = dict.fromkeys(host.capacity, 0)
        for pool, num in host.spec.foreign.items():
            if pool in used:
                used[pool] += num
        for model in host.models.values():
            for pool, num in model.entries.items():
                used[pool] = used.get(pool, 0) + num
        return used

    def _is_batch(self, request: Request) -> bool:
        return request.key is not None and request.key in self.scenario.batch_keys

    def _batch_only(self, model: _Model, *, busy: bool = False) -> bool:
        """Whether only batch requests want ``model``: some wait for it or are in flight
        on it, no interactive one; for a ``busy`` model with none (its last ended a moment
        ago), whether that one was batch (as the gateway counts them for turns:
        :func:`capyctl.scheduler.request_classes.batch_only`)."""
        if not self.scenario.batch_keys:
            return False
        batch = model.batch_in_flight
        if batch < model.in_flight:
            return False
        for request, _ in model.queue:
            if not self._is_batch(request):
                return False
            batch += 1
        return batch > 0 or (busy and model.in_flight == 0 and model.last_batch)

    def _group_batch_only(self, model: _Model) -> bool:
        """:meth:`_batch_only` of ``model`` with its model's other replicas (a replica
        brought up for their requests has none of its own)."""
        if not self.scenario.batch_keys:
            return False
        if model.group is None:
            return self._batch_only(model)
        kinds = {self._wanted_by(r) for r in model.group.replicas} - {None}
        return kinds == {True}

    def _wanted_by(self, model: _Model) -> bool | None:
        """True: only batch requests want ``model``; False: an interactive one does; None:
        none does."""
        if model.batch_in_flight < model.in_flight:
            return False
        if any(not self._is_batch(request) for request, _ in model.queue):
            return False
        return True if model.in_flight or model.queue else None

    def _busy(self, model: _Model) -> bool:
        if model.in_flight > 0:
            return True
        grace = steps.busy_grace(ends_seen_here=not self.scenario.server_mode)
        # (to a nanosecond: a clock that added quarter seconds one by one, or at once, may
        # stand a hair either side of the moment the grace ends)
        return model.last_end is not None and self.now - model.last_end < grace - 1e-9

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
                    # A park here is confirmed at once: what it holds is its residual
                    # (the server's, once its probe confirms); else what its last park
                    # left, as the server remembers it (None: never parked, the guess).
                    residual_bytes=max(gpu.values(), default=0)
                    if model.state == "parked"
                    else model.left_parked,
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
                    parks_unverified=spec.parks_unverified,
                    batch=model.state == "ready"
                    and self._busy(model)
                    and self._batch_only(model, busy=True),
                )
            )
        return HostSnapshot(host.id, host.name, host.spec.unified, pools, residents,
                            host.spec.online, self._contenders(host))  # fmt: skip

    def _contenders(self, host: _Host) -> tuple[Contender, ...]:
        """Those waiting for room on ``host`` (as the server's turns hold them)."""
        return tuple(
            Contender(
                m.id,
                m.name,
                self.now - m.wait_since,
                m.spec.priority,
                m.wait_pools,
                m.wait_claim,
                self._batch_only(m),
            )
            for m in host.waiters.values()
            if m.wait_since is not None
        )

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
            batch = busy and self._batch_only(other, busy=True)
            residents.append((
                spec.priority, other.last_used or other.changed_at, other.id, busy,
                ready_for >= spec.min_ready_seconds,
                turn_left(busy, spec.max_turn_seconds, need.waited_seconds, ready_for,
                          need_batch=need.batch, resident_batch=batch) > 0, batch,
            ))  # fmt: skip
        residents.sort()
        order = tuple(r[2:] for r in residents)
        if not self.scenario.batch_keys:
            return (host.version, need.claim_per_gpu_bytes, order)
        # With classes, who goes first among those waiting may change with time alone.
        ahead = tuple(c.goes_before(need.deployment_id, need.standing)
                      for c in self._contenders(host))  # fmt: skip
        return (host.version, need.claim_per_gpu_bytes, order, need.batch, ahead)

    def _need(self, model: _Model, host: _Host, claim: int | None = None) -> Need:
        return Need(model.id, model.name, model.spec.gpus,
                    model.spec.claim_bytes if claim is None else claim,
                    self._engine_ram if claim is None else 0, (host.id,),
                    self.now - model.wait_since if model.wait_since is not None else 0.0,
                    model.spec.priority, model.siblings, model.spec.spread,
                    self._group_batch_only(model))  # fmt: skip

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
        if model.group is not None:
            model.group.version += 1
            self._note_up(model.group)

    def _note_up(self, group: _Group) -> None:
        """The most replicas of ``group`` up at once (ready or coming up) so far."""
        up = sum(1 for r in group.replicas if r.state in scaling.UP)
        group.peak_up = max(group.peak_up, up)

    def _bump(self, host: _Host) -> None:
        host.version += 1
        self._fire(host.changed)

    def _end_hold(self, model: _Model) -> None:
        phase = _phase(model.state)
        if phase is None or model.host is None or self.now <= model.phase_since:
            return
        for pool in model.pools or ():
            self.out.holds.append(
                Hold(model.served, model.host.name, pool, model.phase_since, self.now, phase)
            )
        model.phase_since = self.now

    def _switch(self, model: _Model, kind: str, mode: str, seconds: float, cause: str) -> None:
        host = model.host.name if model.host else ""
        self.out.switches.append(
            Switch(self.now, seconds, kind, mode, model.served, host, tuple(model.pools), cause)
        )

    def _place_initial(self) -> None:
        """Models that hold memory when the replay begins (ready or parked), on their pools."""
        for model in self.models:
            host = self._host_by_name.get(model.home or "")
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
                if pools:
                    model.left_parked = model.residual(claim)
            model.changed_at = -max(model.spec.min_ready_seconds, 0.0) - 1.0
            model.phase_since = 0.0
