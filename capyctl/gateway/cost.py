"""What a request costs in GPU time, measured as it runs.

A request holds its engine from the moment it is counted in flight there to its end. Its
GPU-seconds are that time times the GPUs the engine holds, shared among the requests in
flight on that engine at the same time: two requests together for a second on a 2-GPU
engine are charged 1 GPU-second each. :class:`EngineShares` keeps, for each engine, the
running integral of ``gpus / requests in flight`` over time, so a request's share is the
integral's growth between its start and its end: O(1) at each, however many run.

A switch (the parks and the wake, or the start, that a waiting request needed) is charged
to the requests that waited for it, in equal shares: the seconds its steps took times the
GPUs of the model it made ready (see :class:`~capyctl.gateway.waiting.Waiting`); the wait
for room before them (a model's turn, its minimum time ready) is not GPU work.

Each process counts the requests it forwards: with several API processes serving one
engine, each shares its engine time among its own requests only (docs/budgets.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

_EWMA = 0.2  # weight of the newest request in a model's typical cost


class _Engine:
    __slots__ = ("gpus", "integral", "last", "running")

    def __init__(self, gpus: int, now: float) -> None:
        self.gpus = gpus
        self.running = 0
        self.last = now
        self.integral = 0.0  # GPU-seconds one request in flight here was charged so far

    def advance(self, now: float) -> None:
        if self.running:
            self.integral += (now - self.last) * self.gpus / self.running
        self.last = now


@dataclass(slots=True)
class Held:
    """One request in flight on an engine: where its share started."""

    deployment_id: int
    engine: _Engine
    since: float


class EngineShares:
    """The GPU time of each engine of this process's requests, shared among them."""

    def __init__(self) -> None:
        self._engines: dict[int, _Engine] = {}
        self._typical: dict[int, float] = {}  # a model's GPU-seconds a request, lately

    def begin(self, deployment_id: int, gpus: int) -> Held:
        now = time.monotonic()
        engine = self._engines.get(deployment_id)
        if engine is None:
            engine = self._engines[deployment_id] = _Engine(gpus, now)
        engine.advance(now)
        engine.gpus = gpus
        engine.running += 1
        return Held(deployment_id, engine, engine.integral)

    def end(self, held: Held) -> float:
        """The request's GPU-seconds, now that it ended."""
        engine = held.engine
        engine.advance(time.monotonic())
        engine.running -= 1
        if engine.running <= 0 and self._engines.get(held.deployment_id) is engine:
            del self._engines[held.deployment_id]
        spent = engine.integral - held.since
        before = self._typical.get(held.deployment_id)
        self._typical[held.deployment_id] = (
            spent if before is None else before + _EWMA * (spent - before)
        )
        return spent

    def typical(self, deployment_id: int) -> float | None:
        """What a request of the model cost lately (None: none measured yet)."""
        return self._typical.get(deployment_id)


class SwitchCost:
    """One wake (or start) that requests wait for, and how many of them share it."""

    __slots__ = ("sharing",)

    def __init__(self) -> None:
        self.sharing = 0

    def share(self, steps_seconds: float, gpus: int) -> float:
        """One waiting request's share of the switch's GPU-seconds: the seconds its steps
        took (parks, stops, the wake or start; not the wait for room before them) times
        the GPUs of the model it made ready."""
        if self.sharing <= 0:
            return 0.0
        return steps_seconds * gpus / self.sharing
