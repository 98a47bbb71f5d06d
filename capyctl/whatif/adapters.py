"""Adapters in the replay (docs/adapters.md): LoRA fine-tunes served as models by their
base's engine. A request for an adapter is its base's request until the base's engine has
it (queued, started or woken, routed among replicas, in the same turns as the base's own
requests); then, as :mod:`capyctl.gateway.adapters` and the scheduler's adapters verb
serve it:

- it is counted in flight on the adapter (until its answer ends) and on the base's engine,
  which therefore cannot be parked under a load;
- the engine must hold the adapter: where it does not, one load runs for every request
  waiting for it, taking the adapter's load time; the loads of one engine run one at a
  time (the server's lock per engine); a request for an adapter the engine holds is sent
  to it at once, a load under way there or not (the server looks before the lock);
- a load that finds every slot of the engine taken first unloads the least recently used
  adapter (its last request's end, else its load) with no request in flight; while every
  one serves a request, the load waits (holding the engine's turn to load) for one of
  them to have none in flight, as long as a request may wait for its model (the base's
  ``max_queue_seconds``, from when the load began to look); past that, the requests
  waiting for the load are answered 503 ``adapter_slots_busy`` (the replay's clients do
  not retry). A request's wait holds its load and the load's wait for a slot, as the
  gateway counts them queued;
- an engine parked deep, or stopped, drops its adapters; a ``ram`` park keeps them; one
  ready (or parked in RAM) when a ``--warm`` replay begins holds those its scenario's
  ``loaded_on`` says (``capyctl status --json``'s adapters), as many as its slots.

An unload takes no time here (an engine's call of a few milliseconds); the server looks
for a free slot every :data:`~capyctl.scheduler.actions.adapters.SLOT_POLL_SECONDS`, the
replay the moment one frees.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from typing import Any

from capyctl.scheduler.policy import DEEP
from capyctl.whatif.clock import _Signal, _Until
from capyctl.whatif.model import Request, SimAdapter
from capyctl.whatif.outcome import AdapterLoad
from capyctl.whatif.serving import Serving
from capyctl.whatif.state import _Model

SLOTS_BUSY = "adapter_slots_busy"


class Adapters(Serving):
    """Requests for adapters in their base's engine: loads, and unloads to make room."""

    adapters: dict[str, SimAdapter]  # by name
    _adapter_in_flight: Counter[str]  # requests in flight per adapter, on any engine
    _adapter_idle: _Signal  # an adapter's last request in flight ended

    def _loads_first(self, model: _Model, request: Request, index: int) -> bool:
        adapter = self.adapters.get(request.model)
        if adapter is None:
            return False
        self._adapter_in_flight[adapter.name] += 1
        if adapter.name in model.adapters:
            return False
        waiting = model.loads.get(adapter.name)
        if waiting is not None:  # a load of it is asked already: one for all who wait
            waiting.append((request, index))
            return True
        model.loads[adapter.name] = [(request, index)]
        self._spawn(self._load(model, adapter))
        return True

    def _load(self, model: _Model, adapter: SimAdapter) -> Generator[Any, Any, None]:
        """Have ``model``'s engine hold ``adapter``, then send it the requests waiting."""
        while model.loading:
            yield model.load_turn
        model.loading = True
        try:
            if adapter.name not in model.adapters:
                unloaded = []
                gives_up = self.now + model.spec.max_queue_seconds
                while len(model.adapters) >= model.spec.adapter_slots:
                    victim = self._adapter_victim(model)
                    if victim is None:  # every slot serves a request: wait for one to end
                        if self.now >= gives_up:
                            self._release_load(model, adapter.name, SLOTS_BUSY)
                            return
                        yield _Until(self._adapter_idle, gives_up - self.now)
                        continue
                    del model.adapters[victim]
                    unloaded.append(victim)
                self.out.adapter_loads.append(AdapterLoad(
                    self.now, adapter.load_seconds, adapter.name, model.name, tuple(unloaded)
                ))  # fmt: skip
                yield adapter.load_seconds
                model.adapters[adapter.name] = (self.now, self.now)
            self._release_load(model, adapter.name, None)
        finally:
            model.loading = False
            self._fire(model.load_turn)

    def _adapter_victim(self, model: _Model) -> str | None:
        """The adapter of ``model``'s engine least recently used (then first loaded) with
        no request in flight, as the scheduler's adapters verb picks it; None: all serve."""
        idle = [
            (used, loaded, name)
            for name, (used, loaded) in model.adapters.items()
            if not self._adapter_in_flight[name]
        ]
        return min(idle)[2] if idle else None

    def _release_load(self, model: _Model, name: str, code: str | None) -> None:
        for request, index in model.loads.pop(name, []):
            if code is None:
                self._to_engine(model, request, index)
                continue
            self._answer(index, 503, code, self.now - request.at)
            self._ended(model, request)
            model.in_flight -= 1
            model.batch_in_flight -= self._is_batch(request)
            model.last_batch = self._is_batch(request)
            model.last_used = model.last_end = self.now
            if model.group is not None:
                model.group.version += 1
            if model.host is not None:
                self._fire(model.host.changed)
            if model.in_flight == 0:
                self._fire(model.drained)

    def _ended(self, model: _Model, request: Request) -> None:
        name = request.model
        if name not in self.adapters:
            return
        self._adapter_in_flight[name] -= 1
        if not self._adapter_in_flight[name]:
            self._fire(self._adapter_idle)  # a load waiting for a slot may take its
        held = model.adapters.get(name)
        if held is not None:
            model.adapters[name] = (self.now, held[1])

    def _held_at_start(self) -> None:
        """Engines up when the replay begins (ready, or parked in RAM) hold the adapters
        their scenario says they hold, the first listed first, as many as their slots."""
        for model in self.models:
            if model.state != "ready" and not (model.state == "parked" and model.sleep_mode
                                               != DEEP):  # fmt: skip
                continue
            for adapter in self.adapters.values():
                if len(model.adapters) >= model.spec.adapter_slots:
                    break
                if adapter.base == model.served and model.name in adapter.loaded_on:
                    model.adapters[adapter.name] = (0.0, 0.0)

    def _move(self, model: _Model, state: str) -> None:
        super()._move(model, state)
        if state == "stopped" or (state == "parked" and model.sleep_mode == DEEP):
            model.adapters.clear()  # its engine dropped them: they load again when asked


__all__ = ["SLOTS_BUSY", "Adapters"]
