"""The replay: a trace's requests against a scenario, on a virtual clock.

What is simulated is the clock and the engines (a start, park or wake takes the model's
timing; a request takes its service time; memory is what the ledger would count). What is
decided is decided by the server's code: every placement, every choice of victims and of
their park mode, and every turn comes from :func:`capyctl.scheduler.policy.plan` on a
:class:`~capyctl.scheduler.policy.HostSnapshot` built the way
:mod:`capyctl.scheduler.snapshots` builds it from the ledger, and the loop around it is the
server's step itself, :func:`capyctl.scheduler.steps.until_ready` (how long it pauses, how
an eviction goes, how long a model counts as busy):

- a request for a ready model is sent to its engine at once; one for a model not ready
  joins that model's queue (refused ``queue_full`` past ``max_waiting``), and one wake
  runs per model, however many requests wait for it; every request that waits shares its
  outcome;
- a wake tries (start a stopped model, wake a parked one, evicting the victims the plan
  names, each drained of its requests first, then parked or stopped, up to
  :data:`~capyctl.scheduler.steps.MAX_SWITCH_ROUNDS` rounds); when what is in the way
  passes it notes its wait for room (what turns are decided on) and tries again after
  :data:`~capyctl.scheduler.steps.BUSY_GRACE_SECONDS`, then every
  :data:`~capyctl.scheduler.steps.ROOM_RETRY_SECONDS`, until ``max_queue_seconds``
  (refused ``wake_timeout``); a plan that cannot fit even with everything parked refuses
  at once (``no_capacity``);
- a reconcile pass every :data:`~capyctl.scheduler.executor.RECONCILE_SECONDS` parks models
  idle for their ``idle_park_seconds`` (a model of several replicas once all of them are),
  then takes the scheduler's scaling step for each model of several replicas;
- a model of several replicas has an engine for each (:mod:`capyctl.whatif.replicas`):
  requests are routed among the ready ones, and replicas brought up and parked by the
  scheduler's scaling decision, as the gateway and the scheduler's pass ask it;
- an engine works on ``max_concurrency`` requests at once (no limit: 0), the others
  waiting in it (:mod:`capyctl.whatif.serving`);
- a request for an adapter is its base's request (queue, wake, turns, replicas) until an
  engine of the base has it, which then loads the adapter where it does not hold it,
  unloading the least recently used idle one when its slots are full, waiting for one to
  be idle (up to ``max_queue_seconds``) when every one serves
  (:mod:`capyctl.whatif.adapters`).

Not simulated: engines that fail, parks that keep their memory (an engine already marked for
that is followed: its models are stopped instead), clients that leave, the
per-key fairness inside one model's queue, drain timeouts (a drain waits for its requests),
affinity routing (a trace holds no session or prompt: the fewest in flight).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Iterable
from functools import partial
from typing import Any

from capyctl.scheduler.policy import NoCapacity, Placement
from capyctl.whatif.clock import _Signal
from capyctl.whatif.model import Request, Scenario, SimReplica
from capyctl.whatif.outcome import Outcome, ReplicaSet, Served
from capyctl.whatif.replicas import Replicas
from capyctl.whatif.state import _constant, _Group, _Host, _Model


class Replay(Replicas):
    """One run of a trace against a scenario."""

    def __init__(
        self, scenario: Scenario, requests: Iterable[Request], *, every_try: bool = False
    ) -> None:
        """``every_try``: plan at every try for room, and take the scaling decision of
        every model of several replicas at every pass, as the server does, instead of only
        when something they decide on may have changed (the same answers, slower: tests
        check that they are the same)."""
        self.every_try = every_try
        self.scenario = scenario
        self.requests = list(requests)
        super().__init__()
        self.hosts = [_Host(i + 1, h) for i, h in enumerate(scenario.hosts)]
        self._host_by_name = {h.name: h for h in self.hosts}
        self.models = [_Model(i + 1, m) for i, m in enumerate(scenario.models)]
        self._by_name: dict[str, _Model] = {}
        for model in self.models:
            for name in (model.name, *model.spec.aliases):
                self._by_name.setdefault(name, model)
        # An adapter's requests are its base's until its engine has them.
        self.adapters = {a.name: a for a in scenario.adapters}
        self._adapter_in_flight = Counter()
        self._adapter_idle = _Signal()
        for adapter in scenario.adapters:
            base = self._by_name.get(adapter.base)
            if base is not None:
                self._by_name.setdefault(adapter.name, base)
        self.groups = [self._replicas_of(m) for m in list(self.models) if m.spec.replicas > 1]
        self.out = Outcome(scenario.name)
        self.out.adapters = {a.name: a.base for a in scenario.adapters}
        self.out.adapters_unmeasured = sorted(a.name for a in scenario.adapters if not a.measured)
        self.out.pools = {(h.name, p): c for h in self.hosts for p, c in h.capacity.items()
                          if p != "ram"}  # fmt: skip
        self._queued = 0
        self._memo: dict[tuple[int, int, bool], tuple[tuple[Any, ...], Placement | NoCapacity]] = {}
        self._engine_ram = int(_constant("engine_ram"))
        self._idle_parked = [m for m in self.models if m.spec.idle_park_seconds > 0]
        self._place_initial()
        self._held_at_start()
        for group in self.groups:
            self._note_up(group)

    def _replicas_of(self, first: _Model) -> _Group:
        """The replicas past ``first`` (after every model's first, so that the ids of
        models of one replica are the same with or without them), and their group."""
        spec = first.spec
        replicas = [first]
        for n in range(1, spec.replicas):
            start = spec.replica_set[n - 1] if n <= len(spec.replica_set) else SimReplica(spec.host)
            replicas.append(_Model(len(self.models) + 1, spec, n, start))
            self.models.append(replicas[-1])
        group = _Group(replicas)
        ids = frozenset(r.id for r in replicas)
        for replica in replicas:
            replica.group, replica.siblings = group, ids - {replica.id}
        return group

    def run(self) -> Outcome:
        began = time.perf_counter()
        for index, request in enumerate(self.requests):
            self._at(request.at, partial(self._arrive, request, index))
        self.out.requests = [Served(r.at, r.model, 0, None, 0.0) for r in self.requests]
        if self.groups or self._idle_parked:
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
        for group in self.groups:
            self.out.replica_sets[group.name] = ReplicaSet(group.kept_up, len(group.replicas),
                                                           group.peak_up)  # fmt: skip
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
        if model.group is not None:
            self._arrive_replicas(model.group, request, index)
            return
        if model.state == "ready":
            self._serve(model, request, index)
            return
        self._enqueue(model, request, index)

    # -- reconcile: idle parks, and the replicas' scaling ---------------------------------------

    def _reconcile(self) -> None:
        for model in self._idle_parked:
            if model.state != "ready" or model.in_flight or model.operating or model.spec.pinned:
                continue
            idle = model.spec.idle_park_seconds
            last = max(model.last_end or 0.0, model.changed_at)
            if self.now - last >= idle and (
                model.group is None or self._replicas_idle(model.group, model, idle)
            ):
                self._spawn(self._park_as_best(model, f"after {idle:g}s idle"))
        self._scale_pass()
        self._at(self.now + _constant("reconcile"), self._reconcile)


def replay(scenario: Scenario, requests: Iterable[Request], *, every_try: bool = False) -> Outcome:
    """Replay ``requests`` (sorted by arrival) against ``scenario``."""
    return Replay(scenario, sorted(requests, key=lambda r: r.at), every_try=every_try).run()


__all__ = ["Replay", "replay"]
