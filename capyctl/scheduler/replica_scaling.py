"""The scheduler's pass over the models of several replicas, every few seconds beside
the reconcile passes: it keeps each model's kept-up replicas up while the model serves,
brings one more up when its replicas carry more than ``target_concurrency`` requests in
flight on average (the counts of every API process, in server mode through Redis), and
parks an idle replica beyond the kept-up ones after ``idle_park_seconds``, the most
recently started first. What to do is :func:`capyctl.scheduler.scaling.decide`'s answer,
the same function the gateway asks on each request and the what-if simulator replays;
this pass only reads the replicas' states and acts on one step a model.

A model none of whose replicas is up (parked or stopped: it went idle, or a person parked
it) is left alone: its next request wakes one, and the others follow. A model whose
replicas all went idle parks as a whole, as a model of one replica does
(:mod:`capyctl.scheduler.reconcile`).

Each step is an event, ``deployment.scaled``, with its reason and the figures it was
decided on; a bring-up runs in the background (``bring_up``: standalone's control threads,
a server's workers), through the ledger, its turn and the models' pins like any wake or
start.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime

from django.utils import timezone

from capyctl.deployments.models import Deployment, DesiredState
from capyctl.events.services import record_event
from capyctl.scheduler import actions, deployment_locks, errors, requests_in_progress, scaling

logger = logging.getLogger("capyctl.scheduler")

# A replica brought up that is not up by the next passes (no room, or it failed) is not
# brought up again by this process for this long: one event and one try, not one a pass.
BRING_UP_AGAIN_SECONDS = 30.0
_brought_up: dict[int, float] = {}  # replica id -> when this process last brought it up


def scale_all(bring_up: Callable[[int], object]) -> None:
    """One pass over every model of several replicas that is wanted running;
    ``bring_up(deployment_id)`` makes a replica ready in the background."""
    firsts = Deployment.objects.filter(
        replica_of__isnull=True, replicas__gt=1, desired_state=DesiredState.RUNNING
    ).prefetch_related("replica_set")
    for first in firsts:
        try:
            scale(first, bring_up)
        except errors.SchedulerError as exc:
            logger.warning("scaling %s did not happen: %s", first.name, exc)


def scale(first: Deployment, bring_up: Callable[[int], object]) -> scaling.Step | None:
    """Take the one step :func:`~capyctl.scheduler.scaling.decide` answers for the model
    whose first replica is ``first`` (None: none to take)."""
    rows = [first, *sorted(first.replica_set.all(), key=lambda r: r.replica_index)]
    now = timezone.now()
    views = [view(row, now) for row in rows]
    if not any(v.state in scaling.UP for v in views):
        return None  # asleep: its next request wakes one
    idle = first.setting("idle_park_seconds")
    bounds = scaling.Bounds(
        minimum=min(first.kept_up, len(rows)),
        maximum=len(rows),
        scale_up_wait_seconds=math.inf,  # waits are the gateway's to see
        target_concurrency=first.setting("target_concurrency"),
        idle_park_seconds=idle if idle > 0 else math.inf,
    )
    step = scaling.decide(views, scaling.Demand(0, 0.0), bounds)
    if step is None or deployment_locks.driven_anywhere(step.replica_id):
        return None  # nothing to do, or its step is under way
    if step.action != scaling.PARK and idle > 0 and _all_idle(views, idle):
        return None  # the model is idle: it parks as a whole (reconcile), nothing comes up
    if step.action != scaling.PARK:
        tried = _brought_up.get(step.replica_id)
        if tried is not None and time.monotonic() - tried < BRING_UP_AGAIN_SECONDS:
            return None  # it did not come up lately (no room): not asked again so soon
        _brought_up[step.replica_id] = time.monotonic()
    record_event("deployment.scaled", f"{first.name}: {step.reason}", subject=first.name,
                 deployment_id=step.replica_id, data=dict(step.figures))  # fmt: skip
    if step.action == scaling.PARK:
        actions.park(step.replica_id, actor="system", reason=step.reason)
    else:
        bring_up(step.replica_id)
    return step


def _all_idle(views: list[scaling.ReplicaView], idle: int) -> bool:
    """Whether every replica up has had no request for ``idle`` seconds and has none in
    flight (the model went idle: one of its replicas may already be parked for it)."""
    up = [v for v in views if v.state in scaling.UP]
    return all(v.in_flight == 0 and v.idle_seconds >= idle for v in up)


def view(row: Deployment, now: datetime) -> scaling.ReplicaView:
    """One replica as the scaling decision sees it. Its requests in flight where they
    cannot be counted (Redis away) count as one, so it is not parked as idle."""
    in_flight = requests_in_progress.count_or_none(row.pk)
    last = max((t for t in (row.last_request_at, row.state_changed_at) if t), default=now)
    return scaling.ReplicaView(
        id=row.pk,
        state=row.observed_state,
        in_flight=1 if in_flight is None else in_flight,
        idle_seconds=max(0.0, (now - last).total_seconds()),
        up_since=row.state_changed_at.timestamp() if row.state_changed_at else 0.0,
    )
