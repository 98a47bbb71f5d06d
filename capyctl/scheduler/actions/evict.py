"""Evict: a model that holds memory another needs gives it back (parked, or stopped where
the plan says so), drained of its requests first."""

from __future__ import annotations

import logging

from capyctl.deployments.models import Deployment
from capyctl.events.models import Event
from capyctl.scheduler import deployment_locks, steps
from capyctl.scheduler.actions.common import load
from capyctl.scheduler.actions.park import park_ready
from capyctl.scheduler.actions.stop import drain_and_stop, stop_engine
from capyctl.scheduler.policy import Victim

logger = logging.getLogger("capyctl.scheduler")


def make_room(victims: tuple[Victim, ...], actor: str, *, for_name: str) -> None:
    """Evict each victim a plan named for ``for_name``, in the plan's order."""
    for victim in victims:
        evict(victim, actor, for_name=for_name)


def evict(victim: Victim, actor: str, *, for_name: str) -> None:
    """Park or stop one victim, draining it first, as :func:`steps.evict_how` says; one no
    longer ready is left alone (the next round plans again on what it became). Decided
    under its operating lock, on its row as it is then."""
    with deployment_locks.operating(victim.deployment_id, victim.name):
        _evict(load(victim.deployment_id), victim, actor, for_name=for_name)


def _evict(deployment: Deployment, victim: Victim, actor: str, *, for_name: str) -> None:
    reason = f"to make room for {for_name}" + (", its turn over" if victim.turn_over else "")
    how = steps.evict_how(victim.mode, deployment.observed_state)
    if how == steps.STOP_PARKED:
        # A parked copy in host RAM, or a parked residual on a GPU, that another engine
        # needs: no request is in flight on a parked model, so there is nothing to drain.
        message = f"stopped {deployment.name} (parked) {reason}: {victim.reason}"
        logger.info(message)
        stop_engine(deployment, actor, reason=message)
        return
    if how is None:
        return
    if how == steps.PARK:
        park_ready(deployment, victim.mode, actor=actor, reason=reason, current=True)
        return
    level = Event.Level.WARNING if "copy" in victim.reason else Event.Level.INFO
    message = f"stopped {deployment.name} instead of parking: {victim.reason}"
    drain_and_stop(deployment, actor, reason=f"{message} ({reason})", level=level)
