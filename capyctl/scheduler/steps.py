"""The scheduler's step, one piece of code for the server and the simulator.

:func:`until_ready` is the loop a request for a model that is not ready waits on: try
(start it, or wake it), and while what is in the way passes, pause and try again until the
deadline. It is written once, as a generator over a :class:`ReadyWorld`: the server runs it
on real time with its real drivers and database (:func:`capyctl.scheduler.actions.ensure_ready`,
which sleeps at each :class:`Pause`), the what-if replay on its virtual clock with simulated
engines (:mod:`capyctl.whatif.ensure_ready`, which may skip the pauses whose try would find
the same host). Every decision of the loop, how long it pauses, how an eviction goes, how
long a model counts as busy, is a function here that both call, so the two cannot drift.

Nothing here touches Django: the replay imports it without a database.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

from capyctl.scheduler.errors import (
    NoCapacityError,
    SchedulerError,
    UnavailableError,
    WakeTimeoutError,
)
from capyctl.scheduler.policy import STOP

# A start or wake evicts the victims its plan names and plans again, this many times at
# most: others may take what was freed meanwhile.
MAX_SWITCH_ROUNDS = 4
# While what is in the way of a start or wake will pass, the request tries again this
# often, within its wake timeout (the first time again sooner: see BUSY_GRACE_SECONDS).
ROOM_RETRY_SECONDS = 0.25
# While another caller's switch of the same model is under way, how often to look again.
SWITCH_POLL_SECONDS = 0.05
# A model whose last request ended this recently is still busy: a client that loops sends
# its next one within it. Where each end is seen (standalone), that long; where only
# ``last_request_at`` says (written at most once a second), a second more.
BUSY_GRACE_SECONDS = 0.1
LAST_REQUEST_SLACK_SECONDS = 1.0

# How an eviction goes (:func:`evict_how`).
STOP_PARKED = "stop_parked"  # a parked copy in host RAM that another engine needs: stop it
PARK = "park"  # park it in the victim's mode, drained first
DRAIN_AND_STOP = "drain_and_stop"  # drained, then stopped (its plan says it cannot park)


class NoRoom(Protocol):
    """A try's refusal for want of room."""

    @property
    def lasting(self) -> bool:
        """Whether waiting cannot help."""
        ...


@dataclass(frozen=True)
class Pause:
    """The loop waits before its next try: ``seconds`` (on real time, exactly that long);
    ``for_room``: it waits for room to come (the simulator may skip ahead to the first try
    at which something the plan decides on has changed), else for another caller's switch
    of the same model to end; ``tries``: tries in a row that found no room."""

    seconds: float
    for_room: bool
    tries: int


class ReadyWorld(Protocol):
    """What :func:`until_ready` asks of the world it runs in, for one model."""

    name: str

    def now(self) -> float:
        """Seconds on this world's clock (monotonic)."""
        ...

    def state(self) -> str | None:
        """The model's observed state as it is now (None: it no longer exists); raises
        when it should no longer run (its desired state is stopped)."""
        ...

    def try_lock(self) -> bool:
        """Take the model's lock, if nobody else switches it now."""
        ...

    def unlock(self) -> None: ...

    def try_once(self) -> Generator[Any, Any, NoRoom | None]:
        """Under the lock: start it where it is stopped, wake it where it is parked (else
        nothing); the refusal for want of room, if any."""
        ...

    def waits_on(self, no_room: NoRoom) -> None:
        """Its wait for room lasts past its first try again: say so once."""
        ...

    def wanted(self) -> bool:
        """Whether anyone still waits for it."""
        ...


def until_ready(world: ReadyWorld, deadline: float) -> Generator[Any, Any, None]:
    """Return once the model is ready. Each try takes the model's lock (a caller that does
    not get it waits for the one that has it), so concurrent callers cause one start or
    wake. A refusal that waiting cannot help is raised at once (NoCapacityError); one for
    what passes pauses (:func:`pause_after`) and tries again. Past ``deadline``:
    WakeTimeoutError naming what it waited for (SchedulerError where it waited for another
    caller's switch); once nobody waits any more, it gives up
    before it moves anything (UnavailableError). Yields :class:`Pause` between tries, and
    whatever ``world.try_once`` yields."""
    no_room: NoRoom | None = None  # the last try's: what is in the way will pass
    tries = 0  # tries in a row that found no room
    while True:
        if world.state() == "ready":
            return
        if world.try_lock():
            try:
                no_room = yield from world.try_once()
                if no_room is not None and no_room.lasting:  # waiting cannot help
                    raise (
                        no_room
                        if isinstance(no_room, Exception)
                        else NoCapacityError(str(no_room), lasting=True)
                    )
                tries = tries + 1 if no_room is not None else 0
                if world.state() == "ready":
                    return
                # Told once the wait lasts past its first try again: a first refusal often
                # passes a moment later (the holder's last request had just ended), and
                # "waits for room" beside the park that came at once promised a wait that
                # never happened.
                if tries == 2 and no_room is not None:
                    world.waits_on(no_room)
            finally:
                world.unlock()
        if world.now() >= deadline:
            if no_room is not None:
                raise WakeTimeoutError(str(no_room))  # what it waited for, to its end
            raise SchedulerError(f"{world.name} is still {world.state()} after waiting")
        yield pause_after(no_room, tries)
        if no_room is not None and not world.wanted():
            raise UnavailableError(f"{world.name}: nobody waits for it any more")


def pause_after(no_room: NoRoom | None, tries: int) -> Pause:
    """How long the loop waits before its next try. The first try again for room comes as
    soon as a model that was busy a moment ago (its last request just ended) may give way;
    later ones every :data:`ROOM_RETRY_SECONDS`; a switch of the model by another caller is
    looked at every :data:`SWITCH_POLL_SECONDS`."""
    if no_room is None:
        return Pause(SWITCH_POLL_SECONDS, for_room=False, tries=tries)
    seconds = ROOM_RETRY_SECONDS if tries > 1 else BUSY_GRACE_SECONDS
    return Pause(seconds, for_room=True, tries=tries)


def evict_how(victim_mode: str, observed: str | None) -> str | None:
    """How a victim the plan named gives its memory back, by the state it is in now: a
    parked copy the plan stops is stopped (nothing to drain); a ready one is parked in its
    mode, or drained and stopped where its mode is a stop; any other (it moved on since
    the plan) is left alone: the next round plans again on what it became."""
    if observed == "parked" and victim_mode == STOP:
        return STOP_PARKED
    if observed != "ready":
        return None
    return PARK if victim_mode != STOP else DRAIN_AND_STOP


def busy_grace(ends_seen_here: bool) -> float:
    """How long after its last request ended a model still counts as busy: where each end
    is seen (standalone), :data:`BUSY_GRACE_SECONDS`; where only ``last_request_at`` says
    (server mode), a second more."""
    return BUSY_GRACE_SECONDS + (0.0 if ends_seen_here else LAST_REQUEST_SLACK_SECONDS)
