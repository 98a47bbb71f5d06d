"""Transitions that end an engine's hold: stopping, stopped and failed (memory released, or
kept counted where the engine outlived its end), stuck, recovered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.services import (
    host_lock,
    mark_unconfirmed,
    release,
)
from capyctl.scheduler.transitions.base import announce, move, record


def stopping(deployment_id: int, current: str) -> bool:
    """``current`` -> STOPPING (a new start waits until its memory is released)."""
    return move(deployment_id, [current], ObservedState.STOPPING)


def stuck(deployment: Deployment) -> bool:
    """-> STOPPING from exactly the state and moment a reconcile pass read: if it moved on
    meanwhile (the slow step finished, another pass repaired it), nothing changes."""
    return move(
        deployment.pk,
        [deployment.observed_state],
        ObservedState.STOPPING,
        since=deployment.state_changed_at,
    )


def stopped(
    deployment: Deployment,
    *,
    reason: str,
    level: str = Event.Level.INFO,
    started: float | None = None,
    actor: str = "system",
) -> bool:
    """STOPPING -> STOPPED, its engine ended: its memory released. False: it was no longer
    stopping (repaired meanwhile, or failed), and nothing changed."""
    if deployment.host_id is not None:
        with host_lock(deployment.host_id) as locked:
            won = move(
                deployment.pk,
                [ObservedState.STOPPING],
                ObservedState.STOPPED,
                parked_mode="",
                state_reason=reason,
            )
            if won:
                release(locked, deployment.pk)
    else:
        won = move(
            deployment.pk,
            [ObservedState.STOPPING],
            ObservedState.STOPPED,
            parked_mode="",
            state_reason=reason,
        )
    if not won:
        return False
    message = (
        reason
        if reason.startswith(f"stopped {deployment.name}")
        else f"stopped {deployment.name}: {reason}"
    )
    record(deployment, "deployment.stopped", message, level=level, started=started, actor=actor)
    return True


def failed(
    deployment: Deployment,
    reason: str,
    *,
    actor: str = "system",
    expected: Iterable[str] | None = None,
    level: str = Event.Level.ERROR,
    code: str = "engine_failed",
    engine_gone: bool = True,
    instance_id: int | None = None,
) -> bool:
    """-> FAILED with the reason, from ``expected`` (default: any state but failed, stopped
    or stopping); ``instance_id``: the engine process the caller drove, so it wins only
    while no other process of the deployment lives (a late failure of an old worker leaves
    a newer start or wake alone). Its engine is gone (the caller ended it, or none ran), so
    whatever it held is released, if this call won. ``engine_gone=False``: its process
    could not be ended, so what it held stays counted, as unconfirmed. A call that lost
    changes nothing. The state change only: it ends no engine
    (:func:`operations.end_engine_and_fail` ends it first, then calls this)."""
    states = (
        list(expected)
        if expected is not None
        else [
            s
            for s in ObservedState.values
            if s not in (ObservedState.FAILED, ObservedState.STOPPED, ObservedState.STOPPING)
        ]
    )
    fields: dict[str, Any] = {"state_reason": reason[:2000], "parked_mode": ""}
    if deployment.host_id is not None:
        with host_lock(deployment.host_id) as locked:
            won = move(
                deployment.pk, states, ObservedState.FAILED, instance_id=instance_id, **fields
            )
            if won and engine_gone:
                release(locked, deployment.pk)
            elif won:
                mark_unconfirmed(locked, deployment.pk, "its engine could not be ended")
            if won:
                message = f"{deployment.name}: {reason}"
                announce(deployment.pk, ok=False, code=code, message=message)
    else:
        won = move(deployment.pk, states, ObservedState.FAILED, instance_id=instance_id, **fields)
    if won:
        record(deployment, "deployment.failed", f"{deployment.name} failed: {reason}",
               level=level, actor=actor)  # fmt: skip
    return won


def download_abandoned(deployment: Deployment, reason: str) -> bool:
    """DOWNLOADING -> FAILED: the process that watched the download ended."""
    return failed(
        deployment,
        reason,
        expected=[ObservedState.DOWNLOADING],
        level=Event.Level.WARNING,
        code="unavailable",
    )


def recovered(deployment: Deployment, host: Host, *, shutting_down: bool) -> bool:
    """Any live (or failed) state -> STOPPED: its engine, of a run that ended (or of this
    one, at shutdown), was ended; its memory is released."""
    previous = deployment.observed_state
    with host_lock(host.pk) as locked:
        won = move(
            deployment.pk,
            [previous],
            ObservedState.STOPPED,
            parked_mode="",
            state_reason=f"was {previous} when CapyCTL stopped; it starts again on demand",
        )
        if won:
            release(locked, deployment.pk)
    if not won:
        return False
    if shutting_down:
        record(deployment, "deployment.stopped", f"stopped {deployment.name}: CapyCTL stopped")
    elif previous != ObservedState.FAILED:
        record(
            deployment,
            "deployment.recovered",
            f"{deployment.name} was {previous} when CapyCTL last stopped; its engine was "
            "ended and it starts again on its next request",
        )
    return True
