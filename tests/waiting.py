"""Waiting for what happened, not for a while: a test that needs background work done
(a flush, a cache refresh, a reconcile pass) waits until its effect shows, with a bound
generous enough for a loaded machine, and says what it was waiting for when it gives up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None], what: str, *, timeout: float = 60, interval: float = 0.1
) -> T:
    """Call ``check`` until it returns something true, and return that; fail naming
    ``what`` (and the last value seen) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        seen = check()
        if seen:
            return seen
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout}s: {seen!r}"
        time.sleep(interval)
