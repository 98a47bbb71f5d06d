"""The live dashboard at ``/``: hosts with their pools as bars, models, recent events.

:func:`dashboard_data` reads everything the page shows as plain JSON-able data. The view
renders it into the page (so the page is whole without JavaScript); the WebSocket consumer
(:mod:`capyctl.web.consumers`) sends it again whenever it changes.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import OuterRef, Subquery
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET

from capyctl import controlplane
from capyctl.deployments.adapters import adapter_views
from capyctl.deployments.models import Deployment
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import PoolUsage, pool_usage
from capyctl.scheduler import requests_in_progress, turns
from capyctl.web import metrics
from capyctl.web.timeline import timeline_data
from hostagent.units import format_size

RECENT_EVENTS = 30
# The switch steps a model's "last switch" shows: the kinds the scheduler records when a
# start, park, wake or stop finished (failures show in the state and the event list).
SWITCH_STEPS = {kind: step for kind, step in metrics._STEPS.items() if step != "failure"}
# Bar segments, left to right: what the ledger counts, then what is left.
SEGMENT_ORDER = (
    LedgerEntry.Status.HELD,
    LedgerEntry.Status.PROMISED,
    LedgerEntry.Status.UNCONFIRMED,
    LedgerEntry.Status.FOREIGN,
)


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def format_duration(duration_ms: int | None) -> str:
    """``850 ms``, ``12.4 s``, ``3 min 5 s``: how long a timed step took, for people."""
    if duration_ms is None:
        return ""
    if duration_ms < 1000:
        return f"{duration_ms} ms"
    seconds = duration_ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def _segment(status: str, deployment: str | None, size: int, scale: int) -> dict[str, Any]:
    share = 100 * size / scale if scale > 0 else 0.0
    return {
        "status": status,
        "deployment": deployment,
        "bytes": size,
        "size": format_size(size),
        "percent": round(share, 3),
    }


def _pool_data(usage: PoolUsage, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One bar: a segment per deployment and status, then foreign memory, then free."""
    # A bar spans the capacity; if the ledger counts more (the probe saw foreign memory
    # grow), it spans what is counted, and the pool is marked over.
    scale = max(usage.capacity_bytes, usage.used_bytes)
    rank = {status: index for index, status in enumerate(SEGMENT_ORDER)}
    ordered = sorted(
        entries, key=lambda row: (rank.get(row["status"], 99), row["deployment"] or "")
    )
    segments = [
        _segment(row["status"], row["deployment"], row["bytes"], scale)
        for row in ordered
        if row["bytes"] > 0
    ]
    if usage.free_bytes > 0:
        segments.append(_segment("free", None, usage.free_bytes, scale))
    return {
        "pool": usage.pool,
        "total_bytes": usage.total_bytes,
        "reserve_bytes": usage.reserve_bytes,
        "capacity_bytes": usage.capacity_bytes,
        "held_bytes": usage.held_bytes,
        "promised_bytes": usage.promised_bytes,
        "unconfirmed_bytes": usage.unconfirmed_bytes,
        "foreign_bytes": usage.foreign_bytes,
        "used_bytes": usage.used_bytes,
        "free_bytes": usage.free_bytes,
        "over": usage.used_bytes > usage.capacity_bytes,
        "capacity": format_size(usage.capacity_bytes),
        "used": format_size(usage.used_bytes),
        "free": format_size(max(usage.free_bytes, 0)),
        "reserve": format_size(usage.reserve_bytes),
        "segments": segments,
    }


def _ledger_rows() -> list[dict[str, Any]]:
    rows = LedgerEntry.objects.values(
        "host_id", "host__name", "pool", "status", "bytes", "deployment_id", "deployment__name"
    )
    return [
        {
            "host_id": row["host_id"],
            "host": row["host__name"],
            "pool": row["pool"],
            "status": row["status"],
            "bytes": int(row["bytes"]),
            "deployment_id": row["deployment_id"],
            "deployment": row["deployment__name"],
        }
        for row in rows.order_by("host__name", "pool", "deployment__name")
    ]


def _hosts(ledger: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_pool: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in ledger:
        by_pool[row["host_id"], row["pool"]].append(row)
    hosts = []
    for host in Host.objects.all():
        inventory = host.inventory or {}
        hosts.append(
            {
                "name": host.name,
                "state": host.state,
                "local": host.is_local,
                "address": host.address,
                "probe": inventory.get("probe") or "",
                "measures": host.measures or "",
                "unified": bool(inventory.get("unified")),
                "last_seen_at": _time(host.last_seen_at),
                "pools": [
                    _pool_data(usage, by_pool.get((host.pk, usage.pool), []))
                    for usage in pool_usage(host)
                ],
            }
        )
    return hosts


def _deployments(ledger: list[dict[str, Any]]) -> list[dict[str, Any]]:
    memory: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in ledger:
        if row["deployment_id"] is not None:
            memory[row["deployment_id"]].append(
                {
                    "host": row["host"],
                    "pool": row["pool"],
                    "status": row["status"],
                    "bytes": row["bytes"],
                    "size": format_size(row["bytes"]),
                }
            )
    switches = Event.objects.filter(
        deployment=OuterRef("pk"), kind__in=list(SWITCH_STEPS)
    ).order_by("-created_at", "-id")
    rows = (
        Deployment.objects.annotate(
            switch_kind=Subquery(switches.values("kind")[:1]),
            switch_at=Subquery(switches.values("created_at")[:1]),
            switch_ms=Subquery(switches.values("duration_ms")[:1]),
        )
        .values(
            "id",
            "name",
            "host__name",
            "engine__name",
            "engine__kind",
            "engine__park_unverified_at",
            "desired_state",
            "observed_state",
            "parked_mode",
            "state_reason",
            "state_changed_at",
            "pinned",
            "switch_kind",
            "switch_at",
            "switch_ms",
        )
        .order_by("name")
    )
    waiting = metrics.NOW.waiting  # the gateway's counts in this process
    room = {  # how long each waits for room on its host (whole seconds)
        c.deployment_id: int(c.waited_seconds)
        for host_id in Host.objects.values_list("pk", flat=True)
        for c in turns.contenders(host_id)
    }
    adapters: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for view in adapter_views():  # shown under their base, whose engine serves them
        adapters[view.base].append({"name": view.name, "state": view.state})
    result = []
    for found in rows:
        last_switch: dict[str, Any] | None = None
        if found["switch_kind"] is not None:
            last_switch = {
                "step": SWITCH_STEPS[found["switch_kind"]],
                "kind": found["switch_kind"],
                "at": _time(found["switch_at"]),
                "duration_ms": found["switch_ms"],
                "took": format_duration(found["switch_ms"]),
            }
        own = memory.get(found["id"], [])
        result.append(
            {
                "name": found["name"],
                "host": found["host__name"],
                "engine": found["engine__name"],
                "kind": found["engine__kind"],
                "engine_parks_kept_memory": found["engine__park_unverified_at"] is not None,
                "desired_state": found["desired_state"],
                "observed_state": found["observed_state"],
                "parked_mode": found["parked_mode"] or None,
                "state_reason": found["state_reason"],
                "state_changed_at": _time(found["state_changed_at"]),
                "pinned": found["pinned"],
                "memory": own,
                "memory_bytes": sum(part["bytes"] for part in own),
                "in_flight": requests_in_progress.count_or_none(found["id"]),
                "waiting": int(waiting.get(found["name"], 0)),
                "waiting_for_room_seconds": room.get(found["id"]),
                "last_switch": last_switch,
                "adapters": adapters.get(found["name"], []),
            }
        )
    return result


def _events() -> list[dict[str, Any]]:
    rows = Event.objects.values(
        "id", "created_at", "level", "kind", "subject", "message", "actor", "duration_ms"
    ).order_by("-created_at", "-id")[:RECENT_EVENTS]
    return [
        {
            "id": row["id"],
            "at": _time(row["created_at"]),
            "level": row["level"],
            "kind": row["kind"],
            "subject": row["subject"],
            "message": row["message"],
            "actor": row["actor"],
            "duration_ms": row["duration_ms"],
            "took": format_duration(row["duration_ms"]),
        }
        for row in rows
    ]


def dashboard_data() -> dict[str, Any]:
    """Everything the dashboard shows, as plain data (the same on the page and the socket).

    ``hosts``: each host with its pools; a pool has its capacity and byte counts by ledger
    status and ``segments`` for its bar, one per deployment and status (``held``,
    ``promised``, ``unconfirmed``), then ``foreign``, then ``free`` (capacity - used).
    ``deployments``: each model's states, whether its engine's parks kept memory (its
    models are stopped instead), its ledger bytes per pool, requests in flight
    and waiting (and, while it waits for room, for how long), and its last switch (start,
    park, wake or stop) with how long it took. ``timeline``: the last hour of each GPU pool
    (:func:`capyctl.web.timeline.timeline_data`).
    ``events``: the most recent events, newest first. ``control_plane``: whether Redis
    answers (server mode), and since when it does not. A few queries in all, plus one per
    host for its pools.
    """
    ledger = _ledger_rows()
    return {
        "control_plane": controlplane.state(),
        "hosts": _hosts(ledger),
        "deployments": _deployments(ledger),
        "events": _events(),
        "timeline": timeline_data(ledger=ledger),
    }


@login_required
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    """``/``: the dashboard for staff; other users go to their own keys page."""
    if not request.user.is_staff:
        return redirect("/keys/")
    return render(request, "web/dashboard.html", {"nav": "dashboard", "data": dashboard_data()})
