"""The virtual clock: an event queue, and processes (generators) that wait on it.

A process yields what it waits for: a number of seconds, a :class:`_Signal` (resumed each
time it is fired), or an :class:`_Until` (a signal, or a number of seconds at most).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any


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


class Clock:
    """The replay's time and what is due to happen when."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

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
