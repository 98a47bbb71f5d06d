"""Adapters in the replay (docs/adapters.md): LoRA fine-tunes served as models by their
base's engine. A request for an adapter is its base's request until the base's engine has
it (queued, started or woken, routed among replicas, in the same turns as the base's own
requests); then, as :mod:`capyctl.gateway.adapters` and the scheduler's adapters verb
serve it:

- it is counted in flight on the adapter (until its answer ends) and on the base's engine,
  which therefore cannot be parked under a load;
- the engine must hold the adapter: where it does not, one load runs for every request
  waiting for it, taking the adapter's load time; the loads of one engine run one at a
  time, and a request for an adapter the engine holds waits for a load under way there
  (the server checks under the same lock);
- a load that finds every slot of the engine taken first unloads the least recently used
  adapter (its last request's end, else its load) with no request in flight; when every
  one serves a request, the requests waiting for the load are answered 503
  ``adapter_slots_busy`` (the replay's clients do not retry);
- an engine parked deep, or stopped, drops its adapters; a ``ram`` park keeps them.

An unload takes no time here (an engine's call of a few milliseconds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from typing import Any

from capyctl.scheduler.policy import DEEP
from capyctl.whatif.model import Request, SimAdapter
from capyctl.whatif.outcome import AdapterLoad
from capyctl.whatif.serving import Serving
from capyctl.whatif.state import _Model

SLOTS_BUSY = "adapter_slots_busy"


class Adapters(Serving):
    """Requests for adapters in their base's engine: loads, and unloads to make room."""

    adapters: dict[str, SimAdapter]  # by name
    _adapter_in_flight: Counter[str]  # requests in flight per adapter, on any engine

    def _loads_first(self, model: _Model, request: Request, index: int) -> bool:
        adapter = self.adapters.get(request.model)
        if adapter is None:
            return False
        self._adapter_in_flight[adapter.name] += 1
        if not model.loading and adapter.name in model.adapters:
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
                while len(model.adapters) >= model.spec.adapter_slots:
                    victim = self._adapter_victim(model)
                    if victim is None:
                        self._release_load(model, adapter.name, SLOTS_BUSY)
                        return
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
        held = model.adapters.get(name)
        if held is not None:
            model.adapters[name] = (self.now, held[1])

    def _move(self, model: _Model, state: str) -> None:
        super()._move(model, state)
        if state == "stopped" or (state == "parked" and model.sleep_mode == DEEP):
            model.adapters.clear()  # its engine dropped them: they load again when asked


__all__ = ["SLOTS_BUSY", "Adapters"]
