"""A model of several replicas in the replay (docs/replicas.md): each replica is an engine
of its own, placed, started, parked and woken like a model of its own (the policy keeps
it off the GPUs its siblings hold), and what is decided is decided by the server's code:

- a request goes to one of the model's ready replicas by
  :func:`capyctl.scheduler.routing.choose` on their requests in flight (traces hold no
  affinity key, so the fewest in flight); with none ready, it waits for the one the
  gateway would pick: one coming up, else a parked one, else the first;
- each request sent to a replica asks :func:`capyctl.scheduler.scaling.decide` for one
  more, as the gateway does (its demand: the model's requests whose answer has not begun,
  and the oldest one's wait; one scale-up of the gateway's at a time);
- every :data:`~capyctl.scheduler.executor.RECONCILE_SECONDS` the scheduler's pass asks
  it too, on the replicas' counts (:mod:`capyctl.scheduler.replica_scaling`): it keeps the
  kept-up replicas up while any is up, brings one more up past ``target_concurrency``, and
  parks an idle one beyond the minimum after ``idle_park_seconds``.

A replica is brought up by the server's step (a start or wake, through the ledger, its
turn and the models' pins), nobody waiting on it.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

from capyctl.scheduler import routing, scaling
from capyctl.scheduler.policy import park_mode
from capyctl.whatif.ensure_ready import EnsureReady
from capyctl.whatif.model import Request
from capyctl.whatif.outcome import Scaled
from capyctl.whatif.state import _Group, _Model

# The states the reconcile pass counts as a replica whose engine lives
# (``capyctl.scheduler.transitions.LIVE``): stopped, failed and downloading ones are not.
_LIVE = frozenset(
    ("starting", "ready", "draining", "parking", "parked", "waking", "stopping")
)  # fmt: skip


class Replicas(EnsureReady):
    """Requests routed among a model's replicas, and its scaling steps."""

    groups: list[_Group]
    every_try: bool

    def _arrive_replicas(self, group: _Group, request: Request, index: int) -> None:
        loads = {r.id: r.in_flight for r in group.replicas if r.state == "ready"}
        if loads:
            self._serve(self.models[routing.choose(loads) - 1], request, index)
            return
        self._enqueue(self._waited_for(group), request, index)

    @staticmethod
    def _waited_for(group: _Group) -> _Model:
        """With no replica ready, the one a request waits for, as the gateway picks it:
        one coming up, else a parked one, else the first."""
        for wanted in (scaling.COMING_UP, {scaling.PARKED}):
            for replica in group.replicas:
                if replica.state in wanted:
                    return replica
        return group.replicas[0]

    # -- the gateway: a request sent to a replica ----------------------------------------

    def _began(self, group: _Group, replica: _Model, request: Request) -> None:
        """As :meth:`capyctl.gateway.replicas.Replicas.began` asks
        :func:`capyctl.scheduler.gateway_api.scale_step`: one more replica, or nothing."""
        if group.bringing is not None:
            return  # its scale-up is under way
        views = [
            scaling.ReplicaView(r.id, "ready" if r is replica else r.state, r.in_flight, 0.0, 0.0)
            for r in group.replicas
        ]
        bounds = scaling.Bounds(
            minimum=group.kept_up,
            maximum=len(group.replicas),
            scale_up_wait_seconds=group.scale_up_wait_seconds,
            target_concurrency=group.target_concurrency,
            idle_park_seconds=math.inf,
        )
        step = scaling.decide(views, scaling.Demand(*self._demand(group, request)), bounds)
        if step is not None and step.action in (scaling.WAKE, scaling.START):
            self._bring_up(group, step, by_gateway=True)

    # -- the scheduler's pass --------------------------------------------------------------

    def _scale_pass(self) -> None:
        """As :func:`capyctl.scheduler.replica_scaling.scale` does for each model of
        several replicas wanted running: one step each. A group that found none to take,
        and has not changed since, is passed over until time alone may change that (an
        idle replica's ``idle_park_seconds`` reached), unless ``every_try``."""
        for group in self.groups:
            if group.replicas[0].spec.desired != "running":
                continue
            if (
                group.version == group.quiet_version
                and self.now < group.quiet_until
                and not self.every_try
            ):
                continue
            views = [self._view(r) for r in group.replicas]
            if not any(v.state in scaling.UP for v in views):
                self._quiet(group)
                continue  # asleep: its next request wakes one
            bounds = scaling.Bounds(
                minimum=group.kept_up,
                maximum=len(group.replicas),
                scale_up_wait_seconds=math.inf,  # waits are the gateway's to see
                target_concurrency=group.target_concurrency,
                idle_park_seconds=group.idle_park_seconds,
            )
            step = scaling.decide(views, scaling.Demand(0, 0.0), bounds)
            if step is None:
                self._quiet(group)
                continue
            if step.action == scaling.PARK:
                self._scale_down(group, step)
            else:
                self._bring_up(group, step, by_gateway=False)

    def _quiet(self, group: _Group) -> None:
        """The pass found nothing to do for ``group``: nor will it until the group changes
        or, a little before, an idle ready replica reaches ``idle_park_seconds``."""
        group.quiet_version = group.version
        group.quiet_until = min(
            (self._last(r) + group.idle_park_seconds - 1e-6
             for r in group.replicas if r.state == "ready" and not r.in_flight),
            default=math.inf,
        )  # fmt: skip

    def _view(self, replica: _Model) -> scaling.ReplicaView:
        return scaling.ReplicaView(
            id=replica.id,
            state=replica.state,
            in_flight=replica.in_flight,
            idle_seconds=max(0.0, self.now - self._last(replica)),
            up_since=replica.changed_at,
        )

    @staticmethod
    def _last(model: _Model) -> float:
        """When it was last used: its last request's end, or its last change of state."""
        if model.last_end is None:
            return model.changed_at
        return max(model.last_end, model.changed_at)

    def _replicas_idle(self, group: _Group, model: _Model, idle: float) -> bool:
        """Whether every other replica of ``group`` than ``model`` is idle too, so that
        the model parks as a whole (``capyctl.scheduler.reconcile``): parked, stopped, or
        ready with nothing in flight for ``idle`` seconds."""
        for other in group.replicas:
            if other is model or other.state not in _LIVE or other.state == "parked":
                continue
            if other.state != "ready":
                return False  # coming up or going down: not idle
            if self.now - self._last(other) < idle or other.in_flight:
                return False
        return True

    # -- the steps ---------------------------------------------------------------------------

    def _bring_up(self, group: _Group, step: scaling.Step, *, by_gateway: bool) -> None:
        replica = self.models[step.replica_id - 1]
        if replica.state in scaling.UP:
            return  # up already: nothing to do
        if by_gateway:
            group.bringing = replica
        if replica.scale_up is not None:
            return  # a scale-up of it is under way
        replica.scale_up = Scaled(self.now, group.name, replica.name, step.action, step.reason,
                                  done=False)  # fmt: skip
        self.out.scaled.append(replica.scale_up)
        if not replica.waking:  # else a request's wake of it runs: it shares that one
            replica.waking = True
            self._spawn(self._ensure_ready(replica))

    def _scale_down(self, group: _Group, step: scaling.Step) -> None:
        replica = self.models[step.replica_id - 1]
        if replica.state != "ready" or replica.operating:
            return  # only a ready model can be parked
        self.out.scaled.append(Scaled(self.now, group.name, replica.name, step.action,
                                      step.reason))  # fmt: skip
        self._spawn(self._park_as_best(replica, step.reason))

    def _park_as_best(self, model: _Model, cause: str) -> Generator[Any, Any, None]:
        """Park ``model`` in the best mode it allows on its host (a stop where it cannot
        park), as an idle park does."""
        host = model.host
        if host is None:
            return
        snap = self._snapshot(host)
        resident = next(r for r in snap.residents if r.deployment_id == model.id)
        ram_free = snap.pools[snap.ram_pool].free_bytes if snap.ram_pool in snap.pools else 0
        mode, _why = park_mode(resident, snap, ram_free)
        yield from self._park(model, mode, cause)
