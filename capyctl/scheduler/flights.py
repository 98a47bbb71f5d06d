"""One re-entrant lock per deployment, in this process: a start, wake, park or stop of one
deployment runs alone here. Across processes the conditional transitions decide (see
:mod:`capyctl.scheduler.transitions`); these locks only spare a process from racing itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from capyctl.scheduler.errors import SchedulerError

_flights: dict[int, threading.RLock] = {}
_flights_lock = threading.Lock()
OPERATION_LOCK_SECONDS = 3600.0


def flight(deployment_id: int) -> threading.RLock:
    with _flights_lock:
        return _flights.setdefault(deployment_id, threading.RLock())


@contextlib.contextmanager
def operating(deployment_id: int, name: str) -> Iterator[None]:
    """Hold the deployment's lock for the block (re-entrant)."""
    lock = flight(deployment_id)
    if not lock.acquire(timeout=OPERATION_LOCK_SECONDS):
        raise SchedulerError(f"{name}: another operation on it did not finish")
    try:
        yield
    finally:
        lock.release()


def flight_free(deployment_id: int) -> bool:
    """Whether no operation on the deployment is under way in this process."""
    lock = flight(deployment_id)
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False
