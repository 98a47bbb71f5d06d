"""Restarting a model's engines: to take new engine arguments, settings or an upgraded
engine program (an engine is launched with them at its start).

:func:`restart` with ``rolling``: its replicas one at a time, the ready ones in order.
Before a replica goes, where the others ready would fall under the replicas the model
keeps up (``min_replicas``, or all), another replica is brought up first (a parked one
woken, else a stopped one started); each replica finishes its requests in flight (it
takes no new ones; they go to the others), stops, starts again and is ready before the
next one goes. Where the memory or the replicas do not allow as many ready, it goes on
and says so. A parked replica is stopped (its next wake is a fresh start). Without
``rolling``: every replica finishes its requests and stops, then the ready ones start
again (requests wait meanwhile, as for any start).

Each step goes through the scheduler's verbs (drain, stop, start, wake), so the ledger,
turns and pins apply as to any start.
"""

from __future__ import annotations

from django.db.models import Q

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.events.models import Event
from capyctl.scheduler import actions
from capyctl.scheduler.errors import SchedulerError

_UP = (ObservedState.READY, ObservedState.PARKED)


def restart(deployment_id: int, *, rolling: bool, actor: str = "system") -> str:
    """Restart the deployment's engines (see the module's docstring); what was done, in
    one line. Raises SchedulerError when none runs, or a replica does not come back."""
    first = actions.load(deployment_id)
    rows = _rows(first)
    up = [r for r in rows if r.observed_state in _UP]
    if not up:
        raise SchedulerError(f"{first.name} is not running; start it instead")
    notes: list[str] = []
    if rolling:
        for row in up:
            _roll(first, row, actor, notes)
    else:
        ready = [r for r in up if r.observed_state == ObservedState.READY]
        for row in up:
            _stop(row, actor, "restarting")
        for row in ready:
            actions.ensure_ready(row.pk, actor)
    how = "one replica at a time" if rolling and len(rows) > 1 else "all at once"
    if rolling and len(rows) == 1:
        how = "its only replica"
    names = ", ".join(r.name for r in up)
    return "; ".join([f"{first.name} restarted ({how}): {names}", *notes])


def _rows(first: Deployment) -> list[Deployment]:
    rows = Deployment.objects.filter(Q(pk=first.pk) | Q(replica_of_id=first.pk))
    return list(rows.select_related("engine", "host").order_by("replica_index"))


def _roll(first: Deployment, row: Deployment, actor: str, notes: list[str]) -> None:
    """Restart one replica, keeping as many others ready as the model keeps up."""
    row = actions.load(row.pk)
    if row.observed_state == ObservedState.PARKED:
        _stop(row, actor, "restarted (rolling) while parked")
        return
    if row.observed_state != ObservedState.READY:
        return  # stopped or failed meanwhile: nothing of it to restart
    rows = _rows(first)
    others = [r for r in rows if r.pk != row.pk]
    kept = min(first.kept_up, len(rows))
    ready = sum(1 for r in others if r.observed_state == ObservedState.READY)
    if ready < kept and _bring_up_spare(others):
        ready += 1
    if ready < kept:
        notes.append(
            f"{ready} of the {kept} it keeps up ready while {row.name} restarted "
            + ("(it has one replica)" if len(rows) == 1 else "(no other replica could come up)")
        )
    _stop(row, actor, "restarting (rolling)")
    try:
        actions.ensure_ready(row.pk, actor)
    except SchedulerError as exc:
        raise SchedulerError(
            f"{row.name} did not come back after its restart ({exc}); the rolling restart "
            "stopped there"
        ) from exc


def _bring_up_spare(others: list[Deployment]) -> bool:
    """Bring another replica up (a parked one woken first, else a stopped one started):
    whether one is ready now."""
    parked = [r for r in others if r.observed_state == ObservedState.PARKED]
    stopped = [r for r in others if r.observed_state == ObservedState.STOPPED]
    for spare in (*parked, *stopped):
        try:
            actions.ensure_ready(spare.pk)
        except SchedulerError:
            continue
        return True
    return False


def _stop(row: Deployment, actor: str, why: str) -> None:
    """Its requests in flight finish, then it stops (a parked one stops at once)."""
    row = actions.load(row.pk)
    if row.observed_state == ObservedState.READY and actions.drain_and_stop(
        row, actor, reason=why, level=Event.Level.INFO
    ):
        return
    actions.stop_engine(row, actor, reason=why)
