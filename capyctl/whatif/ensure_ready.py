"""A wake on the virtual clock: the server's step, :func:`capyctl.scheduler.steps.until_ready`,
run in the replay's world.

One wake runs per model, however many requests wait for it. The step tries (start a
stopped model, wake a parked one, evicting the victims the plan names, each drained of its
requests first, then parked or stopped, as :func:`~capyctl.scheduler.steps.evict_how`
says), and while what is in the way passes it pauses as the step says, here skipping the
tries that would find the same host. What this module holds is the world only: the
simulated engines' times, the replay's ledger, and how a pause passes on this clock.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

from capyctl.scheduler import steps
from capyctl.scheduler.errors import NoCapacityError, SchedulerError, UnavailableError
from capyctl.scheduler.policy import (
    BATCH_SHARE,
    DEEP,
    RAM,
    STOP,
    TURN_PRIORITY_SECONDS,
    NoCapacity,
    Victim,
    is_gpu_pool,
    room_kept_for,
    standing,
    turn_refusal,
)
from capyctl.whatif.adapters import Adapters
from capyctl.whatif.clock import _Until
from capyctl.whatif.model import Request
from capyctl.whatif.state import _Host, _Model, _pool_names, _ram

# A moment after a tie of two floating-point times (the try that follows it sees it).
_EPSILON = 1e-6


class _Step:
    """The step's world for one model in the replay (:class:`steps.ReadyWorld`)."""

    def __init__(self, replay: EnsureReady, model: _Model) -> None:
        self.replay = replay
        self.model = model
        self.name = model.name

    def now(self) -> float:
        return self.replay.now

    def state(self) -> str | None:
        return self.model.state

    def try_lock(self) -> bool:
        return not self.model.operating  # an eviction or an idle park has it

    def unlock(self) -> None:
        return None

    def try_once(self) -> Generator[Any, Any, NoCapacity | None]:
        return self.replay._try_once(self.model)

    def waits_on(self, no_room: object) -> None:
        return None  # the replay keeps no events

    def wanted(self) -> bool:
        return bool(self.model.queue) or self.model.scale_up is not None


def _cause(model: _Model) -> str:
    return "a scale-up" if model.scale_up is not None and not model.queue else "a request"


class EnsureReady(Adapters):
    """A model's wake, and the parks and stops that make room for it."""

    def _enqueue(self, model: _Model, request: Request, index: int) -> None:
        """The request waits for ``model``, which is not ready: one wake runs for it,
        however many wait (refused ``queue_full`` past ``max_waiting``)."""
        if len(model.queue) >= model.spec.max_waiting:
            self._answer(index, 429, "queue_full", 0.0)
            return
        model.queue.append((request, index))
        self._queued += 1
        if self.scenario.batch_keys and model.wait_host is not None:
            self._fire(model.wait_host.changed)  # its class may change: turns with it
        self._note_waiting()
        if not model.waking:
            model.waking = True
            self._spawn(self._ensure_ready(model))

    def _busy_grace(self) -> float:
        return steps.busy_grace(ends_seen_here=not self.scenario.server_mode)

    def _ensure_ready(self, model: _Model) -> Generator[Any, Any, None]:
        deadline = self.now + model.spec.max_queue_seconds
        step = steps.until_ready(_Step(self, model), deadline)
        try:
            while True:
                try:
                    waits = next(step)
                except StopIteration:
                    self._release_queue(model, None)
                    return
                except NoCapacityError:  # lasting: waiting cannot help
                    self._release_queue(model, "no_capacity", 503)
                    return
                except UnavailableError:  # nobody waits for it any more
                    return
                except SchedulerError:  # past its deadline
                    self._release_queue(model, "wake_timeout", 504)
                    return
                if not isinstance(waits, steps.Pause):
                    yield waits  # a simulated engine's time, or a drain
                elif waits.for_room:
                    yield from self._until_room_may_change(model, waits, deadline)
                else:
                    yield from self._until_switch_ends(model, deadline, waits.seconds)
        finally:
            model.waking = False
            if model.scale_up is not None:  # a scale-up's: it happened if it is ready
                model.scale_up.done = model.state == "ready"
                model.scale_up = None
            if model.group is not None and model.group.bringing is model:
                model.group.bringing = None
            if model.wait_host is not None:
                model.wait_host.waiters.pop(model.id, None)
                self._bump(model.wait_host)
            model.wait_since, model.wait_host, model.wait_pools = None, None, ()

    def _until_switch_ends(
        self, model: _Model, deadline: float, poll: float
    ) -> Generator[Any, Any, None]:
        """Nothing to try until its own switch ends (it starts, wakes, drains or parks): the
        step polls every ``poll`` seconds; it is woken at the first poll after the change,
        or at the deadline's."""
        if self.every_try:
            yield poll
            return
        began = self.now
        left = max(deadline - began, 0.0)
        yield _Until(model.changed, math.ceil(left / poll + 1e-9) * poll)
        ticks = max(math.ceil((self.now - began) / poll - 1e-9), 1)
        rest = began + ticks * poll - self.now
        if rest > 1e-9:
            yield rest

    def _until_room_may_change(
        self, model: _Model, pause: steps.Pause, deadline: float
    ) -> Generator[Any, Any, None]:
        """Wait as the step does between tries for room (``pause``, then every
        :data:`~capyctl.scheduler.steps.ROOM_RETRY_SECONDS`),
        skipping the tries that would find the same host: it wakes at the first try after
        anything the plan decides on may have changed (a change of state or of a request on
        the host, a min_ready_seconds or turn running out, a model no longer busy), or at
        its deadline. A skipped try is one the plan would have answered as before."""
        first = pause.seconds
        step = steps.ROOM_RETRY_SECONDS
        host = model.wait_host
        began = self.now
        if host is None or (model.host is None and len(self.hosts) > 1) or self.every_try:
            yield first  # not on one host yet: every host may change, so every try runs
            return
        horizon = min(self._horizon(host, model), deadline)
        wait = max(horizon - began, first)
        ticks = math.ceil((wait - first) / step - _EPSILON)  # early is harmless: late is not
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
        grace = self._busy_grace()
        batch = self._group_batch_only(model)
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
                elif self._busy(other):  # the same moment, rounded the other way: next try
                    soonest = min(soonest, self.now + _EPSILON)
            turn = spec.max_turn_seconds
            if self.scenario.batch_keys and self._busy(other):
                other_batch = self._batch_only(other, busy=True)
                if batch and not other_batch:
                    continue  # a batch-only wait never ends its turn (its requests do)
                if other_batch and not batch:
                    turn *= BATCH_SHARE
            turn_over = max(since, other.changed_at) + turn
            if turn_over > self.now:
                soonest = min(soonest, turn_over)
        if self.scenario.batch_keys:
            soonest = min(soonest, self._order_flips(host, model, since, batch))
        return soonest

    def _order_flips(self, host: _Host, model: _Model, since: float, batch: bool) -> float:
        """The first moment at which ``model`` and another waiter of ``host`` of the other
        class trade places (a batch wait's standing grows at a quarter of the rate)."""
        soonest = math.inf
        share = BATCH_SHARE if batch else 1.0
        for other in host.waiters.values():
            if other is model or other.wait_since is None:
                continue
            other_share = BATCH_SHARE if self._batch_only(other) else 1.0
            if other_share == share:
                continue
            gap = TURN_PRIORITY_SECONDS * (other.spec.priority - model.spec.priority)
            flips = (share * since - other_share * other.wait_since + gap) / (share - other_share)
            if flips > self.now - _EPSILON:  # a tie goes to the older: the order turns just after
                soonest = min(soonest, max(flips, self.now) + _EPSILON)
        return soonest

    def _try_once(self, model: _Model) -> Generator[Any, Any, NoCapacity | None]:
        if model.state == "stopped":
            return (yield from self._start(model))
        if model.state == "parked":
            return (yield from self._wake(model))
        return None  # starting, waking, draining, parking or stopping: it passes

    def _refused(self, model: _Model, host: _Host, result: NoCapacity,
                 pools: tuple[str, ...] = (), claim: int = 0) -> NoCapacity:  # fmt: skip
        if not result.lasting:  # noted as turns.note does: a wait kept on the same host
            if model.wait_since is None or model.wait_host is not host:
                if model.wait_host is not None:
                    model.wait_host.waiters.pop(model.id, None)
                    self._bump(model.wait_host)
                model.wait_since = self.now
            wait_pools = tuple(result.pools or pools)
            if (model.wait_host, model.wait_pools, model.wait_claim) != (host, wait_pools, claim):
                self._bump(host)
            model.wait_host, model.wait_pools, model.wait_claim = host, wait_pools, claim
            host.waiters[model.id] = model
        return result

    def _source_host(self, model: _Model) -> _Host | None:
        if model.host is not None:
            return model.host
        hosts = self.hosts
        if model.group is not None and model.spec.spread == "hosts":
            # hosts with fewer of its replicas first, as a start picks them
            placed = [r.host for r in model.group.replicas if r is not model and r.host]
            hosts = sorted(hosts, key=placed.count)
        for host in hosts:
            result = self._plan_on(host, model, self._need(model, host))
            if not isinstance(result, NoCapacity):
                return host
        return hosts[0] if hosts else None

    def _start(self, model: _Model) -> Generator[Any, Any, NoCapacity | None]:
        host = self._source_host(model)
        if host is None:
            return NoCapacity(f"no host can run {model.name}: there are no hosts")
        for _round in range(steps.MAX_SWITCH_ROUNDS):
            need = self._need(model, host)
            result = self._plan_on(host, model, need)
            if isinstance(result, NoCapacity):
                return self._refused(model, host, result, claim=need.claim_per_gpu_bytes)
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
            self._switch(model, "start", "", seconds, _cause(model))
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
        for _round in range(steps.MAX_SWITCH_ROUNDS):
            used = self._used(host)
            mine = model.entries
            if all(host.capacity[p] - used[p] + mine.get(p, 0) >= claim for p in pools):
                # It fits; but room freed for a model that has waited longer is kept for it.
                free = {p: host.capacity[p] - used[p] for p in host.capacity if is_gpu_pool(p)}
                taking = {p: claim - mine.get(p, 0) for p in pools}
                waited = self.now - model.wait_since if model.wait_since is not None else 0.0
                standing_now = standing(waited, model.spec.priority,
                                        self._group_batch_only(model))  # fmt: skip
                before = room_kept_for(self._contenders(host), model.id, standing_now, free,
                                       taking)  # fmt: skip
                if before is None:
                    break
                refusal = turn_refusal(model.name, before, tuple(pools))
                return self._refused(model, host, refusal, pools, claim)
            residual = min((mine.get(p, 0) for p in pools), default=0)
            need = self._need(model, host, claim - residual)
            result = self._plan_on(host, model, need, waking=True)
            if isinstance(result, NoCapacity):
                return self._refused(model, host, result, pools, claim - residual)
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
        self._switch(model, "wake", mode, seconds, _cause(model))
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
        how = steps.evict_how(victim.mode, model.state)
        if how == steps.STOP_PARKED:
            yield from self._stop(model, f"{cause}: {victim.reason}")
            return
        if how is None or model.operating:
            return
        # Parked in its mode, or (a STOP mode) drained, then stopped.
        yield from self._park(model, victim.mode if how == steps.PARK else STOP, cause)

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
            model.left_parked = max((model.entries[p] for p in model.pools), default=None)
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
