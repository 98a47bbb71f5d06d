"""``/metrics`` for Prometheus: what the gateway saw in this process, and what the
database says now (the ledger, states, switches). Labels carry model, host, pool and
status names only: never a key or a secret.

A scrape must send ``Authorization: Bearer <CAPYCTL_METRICS_TOKEN>`` or come with a staff
user's session; anything else gets 401 before any query runs.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterator
from http.cookies import CookieError, SimpleCookie
from importlib import import_module
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user
from django.db import close_old_connections
from django.db.models import Count, Q, Sum
from django.http import HttpRequest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from capyctl.deployments.models import Deployment
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler import requests_in_progress, snapshots, turns
from capyctl.web.usage_metrics import UsageCollector

REGISTRY = CollectorRegistry()
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class _Histogram:
    """Bucket counts and a sum per model, kept as plain numbers: the event loop adds to
    them (a dict lookup and a bisect, no lock); a scrape reads a copy."""

    def __init__(self, name: str, text: str, bounds: tuple[float, ...]) -> None:
        self.name, self.text, self.bounds = name, text, bounds
        self.by_model: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, model: str, value: float) -> None:
        entry = self.by_model.get(model)
        if entry is None:
            entry = self.by_model[model] = ([0] * (len(self.bounds) + 1), [0.0])
        entry[0][bisect_left(self.bounds, value)] += 1
        entry[1][0] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.text, labels=["model"])
        for model, (counts, total) in sorted(dict(self.by_model).items()):
            running, buckets = 0, []
            for bound, n in zip((*self.bounds, float("inf")), list(counts), strict=True):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
            family.add_metric([model], buckets, total[0])
        return family


LATENCY = _Histogram(
    "capyctl_request_seconds", "/v1 requests, arrival to the answer's headers", _LATENCY
)
OVERHEAD = _Histogram(
    "capyctl_overhead_seconds",
    "CapyCTL's own time in a /v1 request (no waiting, no engine)",
    _OVERHEAD,
)
WAITS = _Histogram("capyctl_wait_seconds", "time /v1 requests waited for a start or wake", _LATENCY)
# Labelled by the adapter's name ("model"): a load is made by a request for it.
ADAPTER_LOADS = _Histogram(
    "capyctl_adapter_load_seconds",
    "adapters loaded into their base's engine, and how long",
    _LATENCY,
)
_counted: dict[tuple[str, int], int] = {}


_replica_requests: dict[tuple[str, str], int] = {}  # (model, replica row name) -> requests


def count_replica(model: str, replica: str) -> None:
    """A /v1 request sent to one replica of a model of several (on the event loop)."""
    _replica_requests[model, replica] = _replica_requests.get((model, replica), 0) + 1


def count(model: str, status: int, started: float, headers_at: float, overhead: float) -> None:
    """One /v1 answer (on the event loop: plain numbers, no lock)."""
    _counted[model, status] = _counted.get((model, status), 0) + 1
    if headers_at:
        LATENCY.observe(model, headers_at - started)
        OVERHEAD.observe(model, overhead)


# Switch steps as the scheduler records them (events with their durations).
_STEPS = {
    "deployment.ready": "start",
    "deployment.parked": "park",
    "deployment.woke": "wake",
    "deployment.stopped": "stop",
    "deployment.failed": "failure",
}


class _Now(Collector):
    """Read at each scrape: queue depths from the gateway, the rest from the database."""

    def __init__(self) -> None:
        self.waiting: dict[str, int] = {}  # model -> requests waiting for it (the gateway's)
        # Each change of a queue's depth within the last hour: (wall clock, model, depth),
        # for the dashboard's timeline.
        self.history: deque[tuple[float, str, int]] = deque(maxlen=HISTORY_CHANGES)

    def note_waiting(self, model: str, count: int) -> None:
        """The gateway's queue for ``model`` is ``count`` deep now."""
        self.waiting[model] = count
        now = time.time()
        self.history.append((now, model, count))
        while self.history and self.history[0][0] < now - HISTORY_SECONDS:
            self.history.popleft()

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "capyctl_requests", "/v1 requests answered, by model and HTTP status",
            labels=["model", "status"],
        )  # fmt: skip
        for (model, status), n in sorted(dict(_counted).items()):
            requests.add_metric([model, str(status)], n)
        yield requests
        for histogram in (LATENCY, OVERHEAD, WAITS, ADAPTER_LOADS):
            yield histogram.family()
        queue = GaugeMetricFamily(
            "capyctl_waiting_requests", "requests waiting for a model to be ready", labels=["model"]
        )
        for model, count in sorted(self.waiting.items()):
            queue.add_metric([model], count)
        yield queue
        room = GaugeMetricFamily(
            "capyctl_waiting_for_room_seconds",
            "how long each model has waited for room on its host (a turn, a switch under way)",
            labels=["host", "model"],
        )
        holder = GaugeMetricFamily(
            "capyctl_turn_holder",
            "1 for each ready model that holds GPUs others wait for (its turn)",
            labels=["host", "model"],
        )
        waits = []
        for host_id, host_name in Host.objects.order_by("name").values_list("pk", "name"):
            for contender in sorted(turns.contenders(host_id), key=lambda c: c.name):
                room.add_metric([host_name, contender.name], round(contender.waited_seconds, 3))
                waits.append((contender.name, host_id, contender.pools, host_name))
        holders = snapshots.turn_holders([(m, h, p) for m, h, p, _ in waits])
        for host_name, model in sorted({(w[3], name) for w in waits for name in holders[w[0]]}):
            holder.add_metric([host_name, model], 1)
        yield room
        yield holder
        ledger = GaugeMetricFamily(
            "capyctl_ledger_bytes",
            "bytes the memory ledger counts",
            labels=["host", "pool", "status"],
        )
        rows = LedgerEntry.objects.values("host__name", "pool", "status").annotate(
            total=Sum("bytes")
        )
        for row in rows.order_by("host__name", "pool", "status"):
            ledger.add_metric([row["host__name"], row["pool"], row["status"]], row["total"] or 0)
        yield ledger
        states = GaugeMetricFamily(
            "capyctl_deployment_state",
            "1 for each model's observed state",
            labels=["model", "state"],
        )
        for name, state in Deployment.objects.order_by("name").values_list(
            "name", "observed_state"
        ):
            states.add_metric([name, state], 1)
        yield states
        yield from _replica_families()
        steps = CounterMetricFamily(
            "capyctl_switch_steps", "starts, parks, wakes, stops and failures", labels=["step"]
        )
        seconds = CounterMetricFamily(
            "capyctl_switch_step_seconds", "time those steps took", labels=["step"]
        )
        done = (
            Event.objects.filter(kind__in=list(_STEPS))
            .values("kind")
            .annotate(n=Count("id"), ms=Sum("duration_ms"))
        )
        for step in done.order_by("kind"):
            steps.add_metric([_STEPS[step["kind"]]], step["n"])
            seconds.add_metric([_STEPS[step["kind"]]], (step["ms"] or 0) / 1000)
        yield steps
        yield seconds


def _replica_families() -> Iterator[Metric]:
    """Each model's replicas by state; for a model of several, each replica's requests
    and its requests in flight."""
    replicas = GaugeMetricFamily(
        "capyctl_replicas",
        "each model's replicas (its engines), by observed state",
        labels=["model", "state"],
    )
    counted = Counter(
        (row.served_name, row.observed_state)
        for row in Deployment.objects.only("name", "observed_state")
    )
    for (model, state), count in sorted(counted.items()):
        replicas.add_metric([model, state], count)
    yield replicas
    sent = CounterMetricFamily(
        "capyctl_replica_requests",
        "/v1 requests sent to each replica of a model of several",
        labels=["model", "replica"],
    )
    for (model, replica), n in sorted(dict(_replica_requests).items()):
        sent.add_metric([model, replica], n)
    yield sent
    in_flight = GaugeMetricFamily(
        "capyctl_replica_in_flight",
        "requests in flight on each replica of a model of several (every API process's "
        "in server mode)",
        labels=["model", "replica"],
    )
    several = Deployment.objects.filter(
        Q(replicas__gt=1, replica_of__isnull=True) | Q(replica_of__isnull=False)
    )
    for row in several.order_by("name").only("name"):
        known = requests_in_progress.count_if_known(row.pk)
        if known is not None:
            in_flight.add_metric([row.served_name, row.name], known)
    yield in_flight


HISTORY_SECONDS = 3600.0
HISTORY_CHANGES = 20_000
NOW = _Now()
REGISTRY.register(NOW)
REGISTRY.register(UsageCollector())


def _scrape() -> bytes:
    close_old_connections()
    try:
        return generate_latest(REGISTRY)
    finally:
        close_old_connections()


def _header(scope: dict[str, Any], name: bytes) -> bytes:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value)
    return b""


def _token_ok(scope: dict[str, Any]) -> bool:
    expected = settings.METRICS_TOKEN
    scheme, _, given = _header(scope, b"authorization").partition(b" ")
    if not expected or scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(given.strip(), expected.encode())


def _staff_session(cookie_header: bytes) -> bool:
    """Whether the request's session cookie is a logged-in, active staff user's."""
    try:
        cookies = SimpleCookie(cookie_header.decode("latin-1"))
    except CookieError:
        return False
    morsel = cookies.get(settings.SESSION_COOKIE_NAME)
    if morsel is None or not morsel.value:
        return False
    close_old_connections()
    try:
        request = HttpRequest()
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(morsel.value)
        user = get_user(request)
        return bool(user.is_authenticated and user.is_active and user.is_staff)
    finally:
        close_old_connections()


async def _refuse(send: Any) -> None:
    body = b"/metrics needs Authorization: Bearer <CAPYCTL_METRICS_TOKEN> or a staff login\n"
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Bearer realm="capyctl-metrics"'),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def metrics_application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``GET /metrics`` (the database is read on a worker thread, off the event loop)."""
    if not _token_ok(scope):
        cookie = _header(scope, b"cookie")
        if not cookie or not await asyncio.to_thread(_staff_session, cookie):
            await _refuse(send)
            return
    body = await asyncio.to_thread(_scrape)
    headers = [
        (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
