"""The one thing the gateway awaits: ``await wakes.ready(deployment_id, timeout)``.

How a wake runs is decided here, not by the caller. Standalone runs the scheduler's
:func:`~capyctl.scheduler.actions.ensure_ready` in this process, on a pool of threads of
its own: slow starts never take the threads that the gateway's route and key lookups run
on, so a ready model answers while others start. Server mode sends the wake to a Celery
worker and waits for its outcome on the channel layer, reading the database every half
second too, so a lost message costs half a second (a failure), or that and
:data:`TOLD_AFTER_READY_SECONDS` (a success: the wait for what it switched), not the wake
timeout.

Failures are raised as the scheduler's typed errors (:mod:`capyctl.scheduler.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection

from capyctl.deployments.models import Deployment
from capyctl.scheduler import actions, notify, switches
from capyctl.scheduler.errors import (
    ControlPlaneUnavailableError,
    SchedulerError,
    WakeTimeoutError,
    error_for,
    is_control_plane_error,
)

logger = logging.getLogger("capyctl.scheduler")

# Starts and wakes wait on engines for minutes; each holds one of these threads meanwhile.
CONTROL_THREADS = 64
_pool: ThreadPoolExecutor | None = None


def _control_pool() -> ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 - one pool a process, made on first use
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=CONTROL_THREADS, thread_name_prefix="capyctl-wake")
    return _pool


def _closing(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    finally:
        # The pool's threads stay (64 at most): each keeps its SQLite connection (opening
        # one is a good part of a wake's own time); a server's are closed after each call.
        if connection.vendor != "sqlite" or connection.errors_occurred:
            connection.close()


async def run(function: Any, *args: Any) -> Any:
    """Run a blocking scheduler call on the control plane's own threads."""
    return await asyncio.get_running_loop().run_in_executor(
        _control_pool(), _closing, function, *args
    )


async def ready(
    deployment_id: int, timeout: float, wanted: Callable[[], bool] | None = None
) -> str:
    """Return once the deployment is ready (started or woken as needed), with what was
    switched for it (``parked a (ram) 412 ms; woke b 688 ms``; empty when nothing was, or
    another caller did it); raise a SchedulerError subclass when it cannot be,
    WakeTimeoutError past ``timeout``. ``wanted``: whether anyone still waits for it; while
    it waits for room, a wake nobody wants any more gives up before it moves anything
    (standalone; a worker in server mode goes on)."""
    if settings.CELERY_TASK_ALWAYS_EAGER:  # here, on the control plane's threads
        return str(await run(_ready_here, deployment_id, timeout, wanted))
    return await _on_worker(deployment_id, timeout)


def ready_later(deployment_id: int) -> None:
    """Make the deployment ready in the background on the control plane's threads,
    nobody waiting on it (standalone; a server's worker sends it to another worker).
    Its failure is its own state and events."""
    _control_pool().submit(_closing, _ready_quietly, deployment_id)


def later(function: Callable[[int], object]) -> Callable[[int], None]:
    """``function(deployment_id)`` run in the background on the control plane's threads
    (standalone); its failure is logged (its events and states say the rest)."""

    def submit(deployment_id: int) -> None:
        _control_pool().submit(_closing, _quietly, function, deployment_id)

    return submit


def _quietly(function: Callable[[int], object], deployment_id: int) -> None:
    try:
        function(deployment_id)
    except SchedulerError as exc:
        logger.info("%s of deployment %s: %s", function.__name__, deployment_id, exc)


def _ready_quietly(deployment_id: int) -> None:
    try:
        actions.ensure_ready(deployment_id, "system")
    except SchedulerError as exc:  # nobody waits for it: its events say what happened
        logger.info("deployment %s was not brought up: %s", deployment_id, exc)


def _ready_here(deployment_id: int, timeout: float, wanted: Callable[[], bool] | None) -> str:
    with switches.collecting() as steps:
        actions.ensure_ready(deployment_id, "system", timeout, wanted)
    return switches.header(steps)


def _state(deployment_id: int) -> tuple[str, str, float] | None:
    """Its state, the reason given, and since when (epoch seconds; 0: unknown)."""
    row = (
        Deployment.objects.filter(pk=deployment_id)
        .values_list("observed_state", "state_reason", "state_changed_at")
        .first()
    )
    if row is None:
        return None
    return row[0], row[1], row[2].timestamp() if row[2] is not None else 0.0


# The scheduler gives up at the wake timeout and says why (what it waited for); a waiter
# gives it this much longer, so the answer carries the reason rather than a bare timeout.
OUTCOME_GRACE_SECONDS = 1.0

# How long a request that needs a switch waits for Redis to answer before it is told 503
# control_plane_unavailable (within its own wake timeout).
CONTROL_PLANE_PATIENCE_SECONDS = 10.0


async def _on_worker(deployment_id: int, timeout: float) -> str:
    # Server mode only: standalone never uses Celery or the channel layer for a wake.
    layer = get_channel_layer()
    channel = await layer.new_channel()
    group = notify.group(deployment_id)
    deadline = time.monotonic() + timeout + OUTCOME_GRACE_SECONDS
    sent_at = time.time()
    await _send(layer, group, channel, deployment_id, deadline=deadline)
    try:
        while time.monotonic() < deadline:  # past it, the next request sends a new wake
            try:
                outcome = await asyncio.wait_for(layer.receive(channel), timeout=0.5)
            except Exception as exc:
                if not isinstance(exc, TimeoutError):
                    if not is_control_plane_error(exc):
                        raise
                    await asyncio.sleep(0.5)  # no outcome over Redis: the database says
                current = await run(_state, deployment_id)
                if current is None:
                    raise SchedulerError("the model no longer exists") from None
                if current[0] == "ready":
                    if current[2] < sent_at:  # ready before the wake was sent: nothing
                        return ""  # was switched for it (its task finds it so)
                    # Its outcome, with the steps, follows once the worker's task ends.
                    return await _switch_told(layer, channel, deadline)
                if current[0] == "failed" and current[2] >= sent_at:  # not an earlier one,
                    raise error_for("engine_failed", current[1]) from None  # being retried
                continue
            if outcome.get("ok"):
                return str(outcome.get("switch") or "")
            raise error_for(str(outcome.get("code")), str(outcome.get("message")))
        raise WakeTimeoutError(f"not ready within {timeout:g}s")
    finally:
        with contextlib.suppress(Exception):  # Redis away: the group's entry expires
            await layer.group_discard(group, channel)


async def _send(
    layer: Any, group: str, channel: str, deployment_id: int, *, deadline: float
) -> None:
    """Listen for the outcome, and send the wake to a worker; while Redis (the broker and
    the channel layer) does not answer, try again for a while."""
    from capyctl.scheduler import tasks  # noqa: PLC0415 - server mode only: standalone never loads Celery

    patience = min(deadline, time.monotonic() + CONTROL_PLANE_PATIENCE_SECONDS)
    while True:
        try:
            await layer.group_add(group, channel)
            await run(tasks.ensure_ready.delay, deployment_id)
            return
        except Exception as exc:
            if not is_control_plane_error(exc):
                raise
            if time.monotonic() >= patience:
                raise ControlPlaneUnavailableError(
                    "Redis does not answer, so the model could not be switched; retry shortly"
                ) from exc
            await asyncio.sleep(0.5)


# How long a waiter that read the model ready listens for the worker's word (what it
# switched, sent once its task ends, a moment after the row): on a busy machine that moment
# passed a quarter of a second. Only a word that never comes (its worker killed just then)
# costs all of it.
TOLD_AFTER_READY_SECONDS = 2.0


async def _switch_told(layer: Any, channel: str, deadline: float) -> str:
    """What the worker says it switched, when its word comes after the database showed the
    model ready (it is sent once the task ends); empty if it does not come in time (the
    waiter's own deadline comes first: a ready model is never answered with a timeout)."""
    patience = min(TOLD_AFTER_READY_SECONDS, deadline - time.monotonic() - 0.1)
    with contextlib.suppress(Exception):
        outcome = await asyncio.wait_for(layer.receive(channel), timeout=max(patience, 0.0))
        if outcome.get("ok"):
            return str(outcome.get("switch") or "")
    return ""
