"""What one wake switched, for the requests that waited for it (``x-capyctl-switch``).

The caller that makes a deployment ready for waiting requests collects (:func:`collecting`)
the steps its transitions record on its thread: ``parked a (ram) 412 ms; woke b 688 ms``.
A collecting caller tells its waiters itself when it is done, with the steps (server mode's
worker), so the transition's own early word is not sent meanwhile (:func:`active`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()

# The events that are steps of a switch, and how each is said.
_STEPS = {
    "deployment.parked": "parked {name} ({mode})",
    "deployment.stopped": "stopped {name}",
    "deployment.woke": "woke {name}",
    "deployment.ready": "started {name}",
}


@contextmanager
def collecting() -> Iterator[list[str]]:
    steps: list[str] = []
    outer = getattr(_local, "steps", None)
    _local.steps = steps
    try:
        yield steps
    finally:
        _local.steps = outer


def active() -> bool:
    return getattr(_local, "steps", None) is not None


def note(kind: str, name: str, duration_ms: int | None, mode: object = None) -> None:
    """A transition's event, as a step of the switch being collected on this thread."""
    steps = getattr(_local, "steps", None)
    template = _STEPS.get(kind)
    if steps is None or template is None:
        return
    step = template.format(name=name, mode=mode or "?")
    steps.append(step if duration_ms is None else f"{step} {duration_ms} ms")


def header(steps: list[str]) -> str:
    """The steps as one header value (ASCII: names are validated, modes are ram/deep)."""
    return "; ".join(steps)


_STEP_MS = re.compile(r" (\d{1,12}) ms(?:;|$)")


def seconds(said: str) -> float:
    """What the steps of a switch took in all (:func:`header`'s value read back): the
    parks, stops and the wake or start, not the wait for room before them."""
    return sum(int(ms) for ms in _STEP_MS.findall(said)) / 1000
