"""Ready: what a request for a model, or a person's "start it", waits on.

:func:`ensure_ready` runs the scheduler's step (:func:`capyctl.scheduler.steps.until_ready`,
the same loop the what-if replay runs on its virtual clock) on real time: each try runs one
verb (:func:`~capyctl.scheduler.actions.start.start_engine` or
:func:`~capyctl.scheduler.actions.wake.wake`) under the model's lock, and while what is in
the way passes (a model inside its ``min_ready_seconds`` or its turn, one switching, memory
not yet confirmed free) it sleeps and tries again until its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

from capyctl.deployments.models import Deployment, DesiredState, ObservedState
from capyctl.scheduler import deployment_locks, steps, transitions, turns
from capyctl.scheduler.actions.common import load
from capyctl.scheduler.actions.park import best_mode, engine_marked, park_ready
from capyctl.scheduler.actions.start import start_engine
from capyctl.scheduler.actions.wake import wake
from capyctl.scheduler.errors import ModelStoppedError, NoCapacityError, SchedulerError
from capyctl.scheduler.policy import STOP
from capyctl.scheduler.steps import ROOM_RETRY_SECONDS

_NEEDS_START = (ObservedState.STOPPED, ObservedState.FAILED, ObservedState.DOWNLOADING)


def ensure_ready(
    deployment_id: int,
    actor: str = "system",
    timeout: float | None = None,
    wanted: Callable[[], bool] | None = None,
) -> Deployment:
    """Make the deployment ready (start it, or wake it), evicting others if needed.

    Any number of concurrent calls for one deployment cause one start or wake; the others
    wait for it and share its outcome. While what is in the way passes, it tries again;
    ``wanted`` says whether anyone still waits (the gateway's queue): once nobody does, it
    gives up before it moves anything (UnavailableError). Past the deadline (``timeout``,
    else its ``max_queue_seconds``): WakeTimeoutError naming what it waited for.
    """
    deployment = load(deployment_id)
    if deployment.desired_state == DesiredState.STOPPED:
        raise ModelStoppedError(f"{deployment.name} is stopped; start it first")
    if deployment.observed_state == ObservedState.READY:
        return deployment
    deadline = time.monotonic() + (timeout or deployment.setting("max_queue_seconds"))
    here = _Here(deployment, actor, wanted)
    try:
        for pause in steps.until_ready(here, deadline):
            time.sleep(pause.seconds)
    finally:
        turns.done(deployment_id)  # its wait for room, if it had one, is over
    if here.deployment.observed_state == ObservedState.READY:
        return here.deployment  # as its own try left it
    return load(deployment_id)  # made ready by another caller


class _Here:
    """The step's world in this process: the database, the model's lock, the verbs."""

    def __init__(
        self, deployment: Deployment, actor: str, wanted: Callable[[], bool] | None
    ) -> None:
        self.deployment = deployment
        self.name = deployment.name
        self.actor = actor
        self._wanted = wanted
        self._flight = deployment_locks.flight(deployment.pk)
        self._known = True  # the row held is as it is now (just read, or just tried)
        self._first = True  # no try yet: the row was read just before

    def now(self) -> float:
        return time.monotonic()

    def state(self) -> str | None:
        if self._known:  # no need to read it again
            self._known = False
            return self.deployment.observed_state
        self._first = False
        row = (
            Deployment.objects.filter(pk=self.deployment.pk)
            .values_list("observed_state", "desired_state")
            .first()
        )
        if row is None:
            return None  # the try says it no longer exists
        if row[1] == DesiredState.STOPPED:
            raise ModelStoppedError(f"{self.name} was stopped meanwhile")
        return row[0]

    def try_lock(self) -> bool:
        if self._flight.acquire(timeout=steps.SWITCH_POLL_SECONDS):
            return True
        self._first = False  # another caller's switch ran meanwhile: read the row again
        return False

    def unlock(self) -> None:
        self._flight.release()

    def try_once(self) -> Generator[Any, Any, NoCapacityError | None]:
        yield from ()  # it runs on real time: it never pauses the loop
        # The first try, its lock taken at once, acts on the row just read (the verbs check
        # the state again under the host lock: a row a moment old costs nothing more).
        if not self._first:
            current = (
                Deployment.objects.filter(pk=self.deployment.pk)
                .values_list("observed_state", "parked_mode")
                .first()
            )
            if current is None:
                raise SchedulerError(f"deployment {self.deployment.pk} no longer exists")
            if current != (self.deployment.observed_state, self.deployment.parked_mode):
                self.deployment = load(self.deployment.pk)
        self._first = False
        self._known = True
        try:
            if self.deployment.observed_state in _NEEDS_START:
                # DOWNLOADING: join the fetch on its host, or pick up one whose asker is
                # gone (a restart); only one caller gets to place it.
                self.deployment = start_engine(self.deployment, self.actor)
            elif self.deployment.observed_state == ObservedState.PARKED:
                self.deployment = wake(self.deployment, self.actor)
        except NoCapacityError as exc:
            if not exc.lasting:
                self.deployment = load(self.deployment.pk)
            return exc
        return None

    def waits_on(self, no_room: object) -> None:
        transitions.record(self.deployment, "deployment.waiting", f"{no_room}", actor=self.actor)

    def wanted(self) -> bool:
        return self._wanted is None or self._wanted()


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


__all__ = ["ROOM_RETRY_SECONDS", "check_park", "ensure_ready", "start"]
