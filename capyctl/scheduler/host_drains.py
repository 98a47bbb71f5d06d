"""Draining a host: what runs there moves to other hosts without dropping a request.

``capyctl host drain NAME`` marks the host (:func:`capyctl.scheduler.host_states.drain_host`);
from then on nothing new is placed there (:func:`capyctl.scheduler.actions.start.source_host`
passes it over). Every few seconds, beside the replicas' pass, :func:`drain_all` looks at
each draining host and sends each model still on it to :func:`move`, in the background:

1. a parked model is stopped (its host RAM given back; its next request starts it on
   another host);
2. a ready model whose host a person chose (or whose engine is installed on that host)
   cannot move: its requests in flight finish, then it is stopped, and says why;
3. a ready replica of a model with another replica ready on another host: its requests
   in flight finish (it takes no new ones meanwhile; they go to the other replicas), then
   it is stopped, and the replicas' pass brings it up again elsewhere if the model keeps
   it up;
4. a ready replica with no other ready elsewhere: another replica is brought up elsewhere
   first (a parked one woken, else a stopped one started), then it goes as in 3;
5. a model of one replica (or one whose other replicas cannot come up elsewhere): where
   another host has room for it, its requests in flight finish, it is stopped and started
   again there at once (requests that arrive meanwhile wait for it, as for any start);
   where none has, it stays and serves, and says so once (``deployment.waiting``): the
   next pass tries again.

When nothing runs on the host any more, the event ``host.drained`` says so, once.
``capyctl host undrain NAME`` takes the host back; nothing moves back by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db.models import Q

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.scheduler import actions, deployment_locks, errors, transitions

logger = logging.getLogger("capyctl.scheduler")

# States a pass acts on; in the others something drives the model already.
_MOVED_FROM = (ObservedState.READY, ObservedState.PARKED)


def drain_all(move_later: Callable[[int], object]) -> None:
    """One pass over the draining hosts: ``move_later(deployment_id)`` runs :func:`move`
    in the background for a model still on one that nothing drives now, one replica of a
    model at a time."""
    for host in Host.objects.filter(drain_started_at__isnull=False):
        left = Deployment.objects.filter(host=host, observed_state__in=transitions.LIVE)
        if not left.exists():
            _note_drained(host)
            continue
        moving: set[int] = set()  # models (by first replica) with a move sent this pass
        rows = left.filter(observed_state__in=_MOVED_FROM).order_by("replica_index")
        for deployment_id, first in rows.values_list("pk", "replica_of_id"):
            model = first or deployment_id
            if model in moving or _model_driven(model):
                continue  # one replica of a model at a time: the others serve meanwhile
            moving.add(model)
            move_later(deployment_id)


def _model_driven(first: int) -> bool:
    """Whether any replica of the model is being started, woken, parked, stopped or moved
    now (its next replica moves once that is done)."""
    rows = Deployment.objects.filter(Q(pk=first) | Q(replica_of_id=first))
    return any(deployment_locks.driven_anywhere(pk) for pk in rows.values_list("pk", flat=True))


def move(deployment_id: int) -> None:  # noqa: PLR0911 - one move, read top to bottom
    """Move one model off its draining host (the steps: the module's docstring)."""
    deployment = actions.load(deployment_id)
    host = deployment.host
    if host is None or host.drain_started_at is None:
        return  # moved already, or the host was taken back
    with deployment_locks.operating(deployment.pk, deployment.name):
        deployment = actions.load(deployment_id)
        if deployment.host_id != host.pk:
            return
        reason = f"its host {host.name} is draining"
        if deployment.observed_state == ObservedState.PARKED:
            actions.stop_engine(deployment, "system", reason=f"{reason}: stopped while parked")
            return
        if deployment.observed_state != ObservedState.READY:
            return
        if not deployment.movable:
            actions.drain_and_stop(
                deployment,
                "system",
                reason=f"{reason}; it cannot move, its host was chosen for it",
                level=Event.Level.WARNING,
            )
            return
        covered = _ready_elsewhere(deployment) or _bring_up_elsewhere(deployment)
        if not covered and not actions.fits_elsewhere(deployment):
            _note_stuck(deployment, host)
            return
        if not actions.drain_and_stop(
            deployment, "system", reason=f"{reason}: moved to another host", level=Event.Level.INFO
        ):
            return
    if not covered:  # nothing else serves it: started again elsewhere at once
        actions.ensure_ready(deployment_id)


def _siblings(deployment: Deployment) -> list[Deployment]:
    first = deployment.replica_of_id or deployment.pk
    rows = Deployment.objects.filter(Q(pk=first) | Q(replica_of_id=first))
    return list(rows.exclude(pk=deployment.pk).select_related("host", "engine"))


def _elsewhere(row: Deployment) -> bool:
    """Whether ``row`` is, or would be placed, on a host that is not draining."""
    if row.host is None:
        return True
    return row.host.drain_started_at is None or row.movable


def _ready_elsewhere(deployment: Deployment) -> bool:
    return any(
        s.observed_state == ObservedState.READY
        and s.host is not None
        and s.host.drain_started_at is None
        for s in _siblings(deployment)
    )


def _bring_up_elsewhere(deployment: Deployment) -> bool:
    """Bring another replica of the model up on a host that is not draining (a parked one
    first, else a stopped one); whether one is ready now."""
    siblings = [s for s in _siblings(deployment) if _elsewhere(s)]
    parked = [s for s in siblings if s.observed_state == ObservedState.PARKED]
    stopped = [s for s in siblings if s.observed_state == ObservedState.STOPPED]
    for spare in (*parked, *stopped):
        if (
            spare.observed_state == ObservedState.PARKED
            and spare.host is not None
            and (spare.host.drain_started_at is not None)
        ):
            continue  # parked on a draining host: it is moved itself
        try:
            actions.ensure_ready(spare.pk)
        except errors.SchedulerError as exc:
            logger.info("%s was not brought up for a drain: %s", spare.name, exc)
            continue
        return True
    return False


def _note_stuck(deployment: Deployment, host: Host) -> None:
    """Said once a drain: no other host has room for a model that cannot stop before it."""
    said = Event.objects.filter(
        kind="deployment.waiting", deployment_id=deployment.pk,
        created_at__gte=host.drain_started_at, message__contains="draining",
    ).exists()  # fmt: skip
    if not said:
        transitions.record(
            deployment,
            "deployment.waiting",
            f"{deployment.name} stays on {host.name}, which is draining: no other host has "
            "room for it now (tried again every few seconds)",
            level=Event.Level.WARNING,
        )


def _note_drained(host: Host) -> None:
    """``host.drained``, once a drain: when nothing runs on the host any more."""
    said = Event.objects.filter(
        kind="host.drained", host_id=host.pk, created_at__gte=host.drain_started_at
    ).exists()
    if not said:
        record_event("host.drained", f"host {host.name} is drained: nothing runs on it",
                     subject=host.name, host_id=host.pk, actor="system")  # fmt: skip
