"""The dashboard's timeline: the last hour of each GPU pool, which model held it when,
its switches and their causes, and the requests waiting beneath.

Read from the events the scheduler records (a model holds its pools from ``ready`` or
``woke`` until ``parked``, ``stopped`` or ``failed``; each timed step is drawn as the
switch it was) and from the gateway's queue depths in this process
(:data:`capyctl.web.metrics.NOW`). Times are wall-clock seconds, so the data changes only
when something happens; the page draws the window up to its own clock.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from django.db.models import OuterRef, Subquery

from capyctl.deployments.models import Deployment
from capyctl.events.models import Event
from capyctl.ledger.models import LedgerEntry
from capyctl.web import metrics

WINDOW_SECONDS = 3600
HOLDS = ("deployment.ready", "deployment.woke")
ENDS = ("deployment.parked", "deployment.stopped", "deployment.failed")
# Timed steps drawn as a switch (from the step's start to its end).
SWITCHING = {"deployment.ready": "start", "deployment.woke": "wake", "deployment.parked": "park",
             "deployment.stopped": "stop"}  # fmt: skip


def _epoch(value: datetime) -> float:
    return round(value.timestamp(), 3)


def _gpu_pools(pools: Any) -> list[str]:
    return [str(p) for p in pools or () if str(p) == "unified" or str(p).startswith("gpu")]


Lane = dict[str, list[dict[str, Any]]]
Holding = dict[int, tuple[str, list[str], float]]  # model -> host, pools, since when


def _span(model: str, start: float, end: float | None, kind: str) -> dict[str, Any]:
    return {"model": model, "from": start, "to": end, "kind": kind}


def _opening(
    since: datetime, now: float, current: dict[int, list[str]]
) -> tuple[Holding, dict[int, tuple[str, str | None]]]:
    """What each model held when the window opened (its last hold or end before it),
    and every model's name and host; ``current``: each model's pools in the ledger now
    (for a hold recorded before events named their pools)."""
    before = Event.objects.filter(
        deployment=OuterRef("pk"), kind__in=(*HOLDS, *ENDS), created_at__lt=since
    ).order_by("-created_at", "-id")
    rows = Deployment.objects.annotate(
        kind=Subquery(before.values("kind")[:1]), data=Subquery(before.values("data")[:1])
    ).values("pk", "name", "host__name", "kind", "data")
    holding: Holding = {}
    names: dict[int, tuple[str, str | None]] = {}
    for row in rows:
        names[row["pk"]] = (row["name"], row["host__name"])
        if row["kind"] in HOLDS and row["host__name"]:
            data = row["data"] or {}
            pools = _gpu_pools(data.get("pools")) or _gpu_pools(current.get(row["pk"]))
            holding[row["pk"]] = (row["host__name"], pools, now - WINDOW_SECONDS)
    return holding, names


def _lanes(since: datetime, holding: Holding) -> dict[tuple[str, str], Lane]:
    """Each (host, pool)'s spans and marks from the window's events; ``holding`` is left
    with the holds still open."""
    lanes: dict[tuple[str, str], Lane] = defaultdict(lambda: {"spans": [], "marks": []})
    events = (
        Event.objects.filter(
            kind__in=(*HOLDS, *ENDS), created_at__gte=since, deployment__isnull=False
        )
        .order_by("created_at", "id")
        .values(
            "deployment_id", "deployment__name", "host__name", "kind", "data", "created_at",
            "duration_ms", "message",
        )
    )  # fmt: skip
    for event in events:
        pk, name, host = event["deployment_id"], event["deployment__name"], event["host__name"]
        at = _epoch(event["created_at"])
        began_step = round(at - (event["duration_ms"] or 0) / 1000, 3)
        step = SWITCHING.get(event["kind"])
        if event["kind"] in HOLDS:
            pools = _gpu_pools((event["data"] or {}).get("pools"))
            if host and pools:
                for pool in pools:
                    lanes[host, pool]["spans"].append(_span(name, began_step, at, str(step)))
                holding[pk] = (host, pools, at)
            continue
        held = holding.pop(pk, None)
        if held is None:
            continue
        host, pools, began = held
        for pool in pools:
            lane = lanes[host, pool]
            lane["spans"].append(_span(name, began, began_step, "held"))
            if step is not None and began_step < at:
                lane["spans"].append(_span(name, began_step, at, step))
            lane["marks"].append({"at": at, "model": name, "text": event["message"]})
    return lanes


def timeline_data(
    now: float | None = None, ledger: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``{"window": seconds, "hosts": [{"host", "pools": [{"pool", "spans", "marks"}],
    "queue": [[t, depth], …]}]}``: a span is ``{"model", "from", "to", "kind"}`` (``to``
    None: still so; ``kind`` ``held`` or the switch step), a mark ``{"at", "model",
    "text"}`` (a park or stop, and why). ``ledger``: the ledger's rows, if read already
    (``deployment_id`` and ``pool`` of each)."""
    now = time.time() if now is None else now
    since = datetime.fromtimestamp(now - WINDOW_SECONDS, tz=UTC)
    if ledger is None:
        ledger = [dict(row) for row in LedgerEntry.objects.values("deployment_id", "pool")]
    current: dict[int, list[str]] = defaultdict(list)
    for row in ledger:
        if row["deployment_id"] is not None:
            current[row["deployment_id"]].append(row["pool"])
    holding, names = _opening(since, now, current)
    lanes = _lanes(since, holding)
    for pk, (host, pools, began) in holding.items():
        for pool in pools:
            lanes[host, pool]["spans"].append(_span(names[pk][0], began, None, "held"))
    hosts: dict[str, dict[str, Any]] = {}
    for (host, pool), lane in sorted(lanes.items()):
        entry = hosts.setdefault(host, {"host": host, "pools": [], "queue": []})
        entry["pools"].append({"pool": pool, **lane})
    model_host = {name: host for name, host in names.values() if host}
    depth: dict[str, dict[str, int]] = defaultdict(dict)
    for at, model, count in list(metrics.NOW.history):
        where = model_host.get(model)
        if where is None or where not in hosts or at < now - WINDOW_SECONDS:
            continue
        depth[where][model] = count
        hosts[where]["queue"].append([round(at, 3), sum(depth[where].values())])
    return {"window": WINDOW_SECONDS, "hosts": list(hosts.values())}
