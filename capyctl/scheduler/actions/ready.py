"""Ready: what a request for a model, or a person's "start it", waits on.

:func:`ensure_ready` starts a stopped model or wakes a parked one, evicting others as the
plan says, and while what is in the way passes (a model inside its ``min_ready_seconds``
or its turn, one switching, memory not yet confirmed free) tries again until its deadline.
Its loop is the only retry frame of the scheduler: each try runs one verb
(:func:`~capyctl.scheduler.actions.start.start_engine` or
:func:`~capyctl.scheduler.actions.wake.wake`) under the model's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from capyctl.deployments.models import Deployment, DesiredState, ObservedState
from capyctl.scheduler import deployment_locks, snapshots, transitions, turns
from capyctl.scheduler.actions.common import load
from capyctl.scheduler.actions.park import best_mode, engine_marked, park_ready
from capyctl.scheduler.actions.start import start_engine
from capyctl.scheduler.actions.wake import wake
from capyctl.scheduler.errors import (
    ModelStoppedError,
    NoCapacityError,
    SchedulerError,
    UnavailableError,
    WakeTimeoutError,
)
from capyctl.scheduler.policy import STOP

# While what is in the way of a start or wake will pass, the request tries again this
# often, within its wake timeout (the first time again sooner: see BUSY_GRACE_SECONDS).
ROOM_RETRY_SECONDS = 0.25
# While another caller's switch of the same model is under way, how often to look again.
SWITCH_POLL_SECONDS = 0.05
_NEEDS_START = (ObservedState.STOPPED, ObservedState.FAILED, ObservedState.DOWNLOADING)


def ensure_ready(  # noqa: PLR0912, PLR0915 - one retry loop, read top to bottom
    deployment_id: int,
    actor: str = "system",
    timeout: float | None = None,
    wanted: Callable[[], bool] | None = None,
) -> Deployment:
    """Make the deployment ready (start it, or wake it), evicting others if needed.

    Any number of concurrent calls for one deployment cause one start or wake: each try
    takes the model's lock (waiting at most :data:`SWITCH_POLL_SECONDS` for it), so the
    others wait for the one that has it and find the model ready. A try that finds no room
    for what passes is tried again (after ``BUSY_GRACE_SECONDS``, then every
    :data:`ROOM_RETRY_SECONDS`), one that waiting cannot help is raised at once. ``wanted``
    says whether anyone still waits (the gateway's queue): once nobody does, it gives up
    before it moves anything (UnavailableError). Past the deadline (``timeout``, else its
    ``max_queue_seconds``): WakeTimeoutError naming what it waited for.
    """
    deployment = load(deployment_id)
    if deployment.desired_state == DesiredState.STOPPED:
        raise ModelStoppedError(f"{deployment.name} is stopped; start it first")
    if deployment.observed_state == ObservedState.READY:
        return deployment
    deadline = time.monotonic() + (timeout or deployment.setting("max_queue_seconds"))
    flight = deployment_locks.flight(deployment_id)
    no_room: NoCapacityError | None = None  # the last try's: what is in the way will pass
    tries = 0  # tries in a row that found no room
    observed: str | None = deployment.observed_state
    desired: str | None = deployment.desired_state
    try:
        while True:
            if observed == ObservedState.READY:
                return load(deployment_id)
            if desired == DesiredState.STOPPED:
                raise ModelStoppedError(f"{deployment.name} was stopped meanwhile")
            if flight.acquire(timeout=SWITCH_POLL_SECONDS):
                try:
                    now_is = (
                        Deployment.objects.filter(pk=deployment_id)
                        .values_list("observed_state", "parked_mode")
                        .first()
                    )
                    if now_is is None:
                        raise SchedulerError(f"deployment {deployment_id} no longer exists")
                    if now_is != (deployment.observed_state, deployment.parked_mode):
                        deployment = load(deployment_id)
                    try:
                        if deployment.observed_state in _NEEDS_START:
                            # DOWNLOADING: join the fetch on its host, or pick up one whose
                            # asker is gone (a restart); only one caller gets to place it.
                            deployment = start_engine(deployment, actor)
                        elif deployment.observed_state == ObservedState.PARKED:
                            deployment = wake(deployment, actor)
                        no_room = None
                    except NoCapacityError as exc:
                        if exc.lasting:  # waiting cannot help: refused at once
                            raise
                        no_room = exc
                        deployment = load(deployment_id)
                    tries = tries + 1 if no_room is not None else 0
                    if deployment.observed_state == ObservedState.READY:
                        return deployment
                    # Told once the wait lasts past its first try again: a first refusal
                    # often passes a moment later (the holder's last request had just
                    # ended), and "waits for room" beside the park that came at once
                    # promised a wait that never happened.
                    if tries == 2:
                        transitions.record(
                            deployment, "deployment.waiting", f"{no_room}", actor=actor
                        )
                finally:
                    flight.release()
            if time.monotonic() >= deadline:
                if no_room is not None:
                    raise WakeTimeoutError(str(no_room))  # what it waited for, to its end
                raise SchedulerError(
                    f"{deployment.name} is still {deployment.observed_state} after waiting"
                )
            # The first try again comes as soon as a model that was busy a moment ago (its
            # last request just ended) may give way; later ones every quarter second.
            if no_room is None:
                time.sleep(SWITCH_POLL_SECONDS)
            else:
                time.sleep(ROOM_RETRY_SECONDS if tries > 1 else snapshots.BUSY_GRACE_SECONDS)
                if wanted is not None and not wanted():
                    raise UnavailableError(f"{deployment.name}: nobody waits for it any more")
            observed, desired = (
                Deployment.objects.filter(pk=deployment_id)
                .values_list("observed_state", "desired_state")
                .first()
            ) or (None, None)
    finally:
        turns.done(deployment_id)  # its wait for room, if it had one, is over


def start(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "run it": desired running, then ready."""
    transitions.desired(deployment_id, "running")
    return ensure_ready(deployment_id, actor)


def check_park(deployment_id: int, actor: str = "system") -> bool:
    """Park a ready model of an engine marked for parks that kept their memory, to see
    whether they free it now, and wake it again: the model is left as it was found. True:
    the park freed its memory, and the engine's models park again."""
    deployment = load(deployment_id)
    host = deployment.host
    if host is None or deployment.observed_state != ObservedState.READY:
        return False
    mode, _ = best_mode(deployment, host, checking=True)
    if mode == STOP:
        return False
    reason = f"to test whether engine {deployment.engine.name}'s parks free memory again"
    if not park_ready(deployment, mode, actor=actor, reason=reason, checking_park=True):
        return False
    if engine_marked(deployment.engine_id):  # back as it was: its memory never left
        with deployment_locks.operating(deployment_id, deployment.name):
            wake(load(deployment_id), actor)
        return False
    ensure_ready(deployment_id, actor)
    return True
