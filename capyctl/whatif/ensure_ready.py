"""A wake, read top to bottom: the loop of
:func:`capyctl.scheduler.operations.ensure_ready`, step by step, on the virtual clock.

One wake runs per model, however many requests wait for it. It tries (start a stopped
model, wake a parked one, evicting the victims the plan names, each drained of its
requests first, then parked or stopped), and while what is in the way passes it waits for
room, skipping the tries that would find the same host.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

from capyctl.scheduler.policy import DEEP, RAM, STOP, NoCapacity, Victim
from capyctl.whatif.clock import _Until
from capyctl.whatif.serving import Serving
from capyctl.whatif.state import _constant, _Host, _Model, _pool_names, _ram

_FIRST_TRY_SECONDS = 0.05  # a try that found nothing in the way, waiting on a switch


class EnsureReady(Serving):
    """A model's wake, and the parks and stops that make room for it."""

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
