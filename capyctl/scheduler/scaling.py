"""When to bring a replica of a model up, or park one: one step at a time, by load.

A model served with ``--replicas MIN:MAX`` runs between MIN and MAX replicas. It scales
from parked replicas: bringing one up wakes a parked replica first (seconds), and starts a
stopped one only where none is parked; an idle replica beyond MIN is parked, the most
recently started first. :func:`decide` looks at the replicas as they are now and the
requests waiting for the model, and answers the one :class:`Step` to take next (or None);
its reason is a sentence for the event log, with the figures that triggered it.

The rules, in order:

1. Fewer replicas up than ``minimum`` (up: ready, starting, waking or downloading): bring
   one up, whatever else is under way.
2. Load calls for one more: a request has waited longer than ``scale_up_wait_seconds``, or
   the ready replicas carry more than ``target_concurrency`` requests in flight on average.
   Then one is brought up if fewer than ``maximum`` are up and none is coming up already
   (one coming up is counted once it is ready: the next decision sees whether it was
   enough). A request waiting with no replica ready needs no rule of its own: with none
   ready and none coming up, none is up, which rule 1 brings up (``minimum`` is at least 1).
3. Nothing waits and load does not call for more: a ready replica idle for
   ``idle_park_seconds`` with nothing in flight is parked, while more than ``minimum`` are
   ready; the most recently started first, so the longest-serving replicas stay.

Failed replicas count as neither up nor available; draining, parking and stopping ones
are on their way down and are neither up nor brought up.

Plain Python, the standard library only: the server's reconcile timer and the what-if
simulator call the same function, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Observed states, as ``capyctl.deployments.models.ObservedState`` names them.
READY = "ready"
STARTING = "starting"
WAKING = "waking"
DOWNLOADING = "downloading"
PARKING = "parking"
PARKED = "parked"
STOPPED = "stopped"
FAILED = "failed"
DRAINING = "draining"
STOPPING = "stopping"
STATES = frozenset(
    (READY, STARTING, WAKING, DOWNLOADING, PARKING, PARKED, STOPPED, FAILED, DRAINING, STOPPING)
)
# Coming up: it will serve soon, and is counted as up so that one burst brings up one
# replica, not one per decision while it loads.
COMING_UP = frozenset((STARTING, WAKING, DOWNLOADING))
UP = COMING_UP | {READY}

# What a step does.
WAKE = "wake"
START = "start"
PARK = "park"


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the decision sees it.

    ``idle_seconds``: since its last request ended, or since it became ready if it has
    served none. ``up_since``: a monotonic time at which it last became ready or began to
    come up; larger is more recent."""

    id: int
    state: str  # an observed state (:data:`STATES`)
    in_flight: int
    idle_seconds: float
    up_since: float

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"replica {self.id}: unknown state {self.state!r}")


@dataclass(frozen=True)
class Demand:
    """The requests waiting for the model now (for a replica, or for room to bring one up)."""

    waiting: int
    oldest_wait_seconds: float  # how long the one waiting longest has waited


@dataclass(frozen=True)
class Bounds:
    """A model's ``--replicas MIN:MAX`` and the figures that say when to scale.

    ``scale_up_wait_seconds``: a request waiting longer than this calls for one more
    replica; ``target_concurrency``: so do ready replicas carrying more requests in flight
    than this on average; ``idle_park_seconds``: a replica idle this long, beyond the
    minimum, is parked."""

    minimum: int
    maximum: int
    scale_up_wait_seconds: float
    target_concurrency: float
    idle_park_seconds: float

    def __post_init__(self) -> None:
        for name in ("minimum", "maximum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be a whole number (got {value!r})")
        if self.minimum < 1:
            raise ValueError(f"minimum must be at least 1 (got {self.minimum})")
        if self.maximum < self.minimum:
            raise ValueError(
                f"maximum must be at least minimum {self.minimum} (got {self.maximum})"
            )
        for name in ("scale_up_wait_seconds", "target_concurrency", "idle_park_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be more than 0 (got {value!r})")


@dataclass(frozen=True)
class Step:
    """What to do next: ``action`` (:data:`WAKE`, :data:`START` or :data:`PARK`) on
    ``replica_id``; ``reason``, one line for the event log; ``figures``, the numbers it
    was decided on, for the event's data."""

    action: str
    replica_id: int
    reason: str
    figures: dict[str, float | int] = field(default_factory=dict)


def decide(replicas: Sequence[ReplicaView], demand: Demand, bounds: Bounds) -> Step | None:
    """The one step to take now, or None (the rules: the module's docstring)."""
    ready = [r for r in replicas if r.state == READY]
    coming = sum(1 for r in replicas if r.state in COMING_UP)
    up = len(ready) + coming
    figures: dict[str, float | int] = {
        "up": up,
        "ready": len(ready),
        "coming_up": coming,
        "minimum": bounds.minimum,
        "maximum": bounds.maximum,
        "waiting": demand.waiting,
        "oldest_wait_seconds": demand.oldest_wait_seconds,
    }
    replicas_up = f"{up} of {bounds.minimum}..{bounds.maximum} replicas up"
    if coming:
        replicas_up += f" ({coming} coming up)"

    if up < bounds.minimum:
        return _bring_up(replicas, f"{replicas_up}, under the minimum {bounds.minimum}", figures)

    why = _load_calls_for_more(ready, demand, bounds, figures)
    if why is not None:
        if coming or up >= bounds.maximum:
            return None  # the one coming up is counted when ready; at maximum, no more
        return _bring_up(replicas, f"{why} with {replicas_up}", figures)

    if demand.waiting > 0 or len(ready) <= bounds.minimum:
        return None
    return _park_one(ready, bounds, figures)


def _load_calls_for_more(
    ready: list[ReplicaView], demand: Demand, bounds: Bounds, figures: dict[str, float | int]
) -> str | None:
    """Why load calls for one more replica (the first half of a reason), or None. Adds
    the figures it looked at to ``figures``."""
    if demand.waiting > 0 and demand.oldest_wait_seconds > bounds.scale_up_wait_seconds:
        figures["scale_up_wait_seconds"] = bounds.scale_up_wait_seconds
        return (
            f"{_requests(demand.waiting)} waited up to {_num(demand.oldest_wait_seconds)} s "
            f"(over scale_up_wait_seconds {_num(bounds.scale_up_wait_seconds)} s)"
        )
    if ready:
        mean = sum(r.in_flight for r in ready) / len(ready)
        figures["mean_in_flight"] = mean
        figures["target_concurrency"] = bounds.target_concurrency
        if mean > bounds.target_concurrency:
            return (
                f"{_ready(len(ready))} {_num(mean)} requests in flight on average "
                f"(over target_concurrency {_num(bounds.target_concurrency)})"
            )
    return None


def _bring_up(
    replicas: Sequence[ReplicaView], why: str, figures: dict[str, float | int]
) -> Step | None:
    """Wake a parked replica, else start a stopped one, else None.

    The parked replica woken is the one that served a request last (least idle: parked
    the most recently), lowest id on a tie: its weights copy is the most likely still warm
    in the host's page cache or RAM, and a replica parked long ago is the one whose memory
    other models are most likely to have claimed since. A stopped replica (never a failed
    one) is started only where none is parked, the lowest id first, so the same replicas
    are used again and again."""
    parked = [r for r in replicas if r.state == PARKED]
    if parked:
        chosen = min(parked, key=lambda r: (r.idle_seconds, r.id))
        return Step(WAKE, chosen.id, f"{why}: waking parked replica {chosen.id}", figures)
    stopped = [r for r in replicas if r.state == STOPPED]
    if stopped:
        chosen = min(stopped, key=lambda r: r.id)
        return Step(START, chosen.id, f"{why}: starting stopped replica {chosen.id}", figures)
    return None


def _park_one(
    ready: list[ReplicaView], bounds: Bounds, figures: dict[str, float | int]
) -> Step | None:
    """Park the most recently started idle ready replica, or None where none is idle."""
    idle = [r for r in ready if r.in_flight == 0 and r.idle_seconds >= bounds.idle_park_seconds]
    if not idle:
        return None
    chosen = max(idle, key=lambda r: (r.up_since, r.id))
    figures = {
        **figures,
        "idle_seconds": chosen.idle_seconds,
        "idle_park_seconds": bounds.idle_park_seconds,
        "up_since": chosen.up_since,
    }
    reason = (
        f"replica {chosen.id} idle {_num(chosen.idle_seconds)} s (at least idle_park_seconds "
        f"{_num(bounds.idle_park_seconds)} s), nothing waiting, {len(ready)} ready over the "
        f"minimum {bounds.minimum}: parking replica {chosen.id}, the most recently started"
    )
    return Step(PARK, chosen.id, reason, figures)


def _num(value: float) -> str:
    """A figure as a person reads it: one decimal, none where it is whole (2, 4.2)."""
    return f"{value:.1f}".removesuffix(".0")


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"


def _ready(count: int) -> str:
    return "1 ready replica carries" if count == 1 else f"{count} ready replicas carry"
