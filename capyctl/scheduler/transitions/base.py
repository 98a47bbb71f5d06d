"""What every transition does: the conditional update of a deployment's state, its event,
the word to waiters in other processes, measured figures held in the ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.services import (
    host_lock,
    set_measured,
)
from capyctl.prepared import PreparedUpdate
from capyctl.scheduler import notify, requests_in_progress, switches
from hostagent.units import format_size

logger = logging.getLogger("capyctl.scheduler")
Status = LedgerEntry.Status

# States a deployment passes through, and those it rests in while its engine lives.
LIVE = (
    ObservedState.STARTING,
    ObservedState.READY,
    ObservedState.DRAINING,
    ObservedState.PARKING,
    ObservedState.PARKED,
    ObservedState.WAKING,
    ObservedState.STOPPING,
)
UNREACHABLE_NOTE = "its host does not answer"


def _rows(expected: tuple[str, ...], wanted: bool) -> Callable[[int], QuerySet[Deployment]]:
    """The rows a move from one of ``expected`` may change (``wanted``: while running is
    wanted)."""

    def rows(deployment_id: int) -> QuerySet[Deployment]:
        found = Deployment.objects.filter(pk=deployment_id, observed_state__in=list(expected))
        return found.filter(desired_state="running") if wanted else found

    return rows


_MOVES: dict[tuple[tuple[str, ...], bool], PreparedUpdate] = {}


def _move_from(expected: tuple[str, ...], wanted: bool) -> PreparedUpdate:
    return _MOVES.setdefault((expected, wanted), PreparedUpdate(_rows(expected, wanted), 1))


def move(
    deployment_id: int,
    expected: Iterable[str],
    new: str,
    *,
    wanted: bool = False,
    since: datetime | None = None,
    instance_id: int | None = None,
    row: Deployment | None = None,
    **fields: object,
) -> bool:
    """The conditional update: ``new`` only from one of ``expected`` (with ``wanted``, only
    while its desired state is running; with ``since``, only if it has not changed since;
    with ``instance_id``, only while no other engine process of it lives: a newer start's
    or wake's is not the caller's to change). ``row``: the caller's copy of the
    deployment, given what was written when the update wins (no need to read it again)."""
    now = timezone.now()
    expected = tuple(expected)
    if since is None and instance_id is None:  # a switch's five moves: their SQL built once
        update = _MOVES.get((expected, wanted)) or _move_from(expected, wanted)
        updated = update(deployment_id, observed_state=new, state_changed_at=now, **fields)
    else:
        rows = _rows(expected, wanted)(deployment_id)
        if since is not None:
            rows = rows.filter(state_changed_at=since)
        if instance_id is not None:
            others = Instance.objects.filter(deployment_id=OuterRef("pk")).exclude(pk=instance_id)
            rows = rows.exclude(Exists(others.exclude(state=Instance.State.EXITED)))
        updated = rows.update(observed_state=new, state_changed_at=now, **fields)
    if updated == 1 and row is not None:
        row.observed_state = new
        row.state_changed_at = now
        for field, value in fields.items():
            setattr(row, field, value)
    if updated == 1 and new == ObservedState.READY:
        requests_in_progress.reopen(deployment_id)  # the drain gate, closed while it drained
    return updated == 1


def record(
    deployment: Deployment,
    kind: str,
    message: str,
    *,
    level: str = Event.Level.INFO,
    started: float | None = None,
    actor: str = "system",
    data: dict[str, object] | None = None,
) -> None:
    """The event of a transition (or of a decision about one)."""
    duration = int((time.monotonic() - started) * 1000) if started is not None else None
    switches.note(kind, deployment.name, duration, (data or {}).get("mode"))
    record_event(
        kind,
        message,
        subject=deployment.name,
        level=level,
        actor=actor,
        deployment_id=deployment.pk,
        host_id=deployment.host_id,
        duration_ms=duration,
        data=data,
    )


def announce(deployment_id: int, **outcome: Any) -> None:
    """Tell the requests waiting on the deployment in other processes (server mode: the
    API's), once what was written is committed. Standalone's waiters await the operation
    itself; a caller that collects the switch tells them when it is done, with its steps."""
    if not settings.CELERY_TASK_ALWAYS_EAGER and not (outcome.get("ok") and switches.active()):
        transaction.on_commit(lambda: notify.announce(deployment_id, **outcome))


def hold_measured(
    host: Host, deployment: Deployment, figures: Mapping[str, int], note: str
) -> None:
    """Measured figures as held (under the host lock); an overshoot past a pool's capacity
    is reported."""
    over = set_measured(host, deployment.pk, figures, note=note)
    for pool, extra in over.items():
        message = (
            f"{deployment.name} uses {format_size(extra)} more in {pool} than the pool has room "
            "for; the pool's reserve is absorbing it"
        )
        logger.warning(message)
        record(deployment, "ledger.overshoot", message, level=Event.Level.WARNING,
               data={"pool": pool, "bytes": extra})  # fmt: skip


def entries(host: Host, deployment_id: int) -> dict[str, int]:
    """The deployment's ledger entries on the host (pool -> bytes)."""
    return dict(
        LedgerEntry.objects.filter(host=host, deployment_id=deployment_id).values_list(
            "pool", "bytes"
        )
    )


def to_ready(
    deployment: Deployment,
    host: Host | int,
    expected: str,
    figures: Mapping[str, int],
    claim_bytes: int | None = None,
    *,
    row: Deployment | None = None,
    **fields: Any,
) -> bool:
    """``expected`` -> READY under the host lock, the measured figures held in place of
    the promise (with ``claim_bytes``, its live instance's claim changed too), waiters
    told; whether this call won. ``row``: as :func:`move`'s. ``host``: as the caller read
    it in this operation, or its id to read it under the lock (see :func:`host_lock`)."""
    with host_lock(host) as locked:
        won = move(deployment.pk, [expected], ObservedState.READY, row=row, **fields)
        if won:
            if claim_bytes is not None:
                Instance.objects.filter(deployment_id=deployment.pk).exclude(
                    state=Instance.State.EXITED
                ).update(claim_bytes=claim_bytes)
            hold_measured(locked, deployment, figures, "measured")
            announce(deployment.pk, ok=True)
    return won
