"""Where each model name goes: the deployment, its state and its engine's address.

A short-lived in-memory table: a request for a ready model costs no database query; the
table is re-read at most every ``TTL_SECONDS`` and right after a wake.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db.models import Q

from capyctl.deployments.models import Deployment, Instance

SOFT_TTL_SECONDS = 0.25  # refreshed in the background past this age
TTL_SECONDS = 1.0  # never used older than this


@dataclass(frozen=True)
class Route:
    deployment_id: int
    name: str
    desired_state: str
    observed_state: str
    parked_mode: str
    host: str | None
    base_url: str | None  # the engine's loopback address while it runs
    launch_key: str
    max_waiting: int
    wake_timeout_seconds: int
    fetched_at: float


def _fetch(name: str) -> Route | None:
    deployment = (
        Deployment.objects.filter(Q(name=name) | Q(aliases__name=name))
        .select_related("host")
        .first()
    )
    if deployment is None:
        return None
    instance = (
        Instance.objects.filter(deployment=deployment, state=Instance.State.RUNNING)
        .only("port", "launch_key")
        .first()
    )
    return Route(
        deployment_id=deployment.pk,
        name=deployment.name,
        desired_state=deployment.desired_state,
        observed_state=deployment.observed_state,
        parked_mode=deployment.parked_mode,
        host=deployment.host.name if deployment.host else None,
        base_url=f"http://127.0.0.1:{instance.port}" if instance and instance.port else None,
        launch_key=instance.launch_key if instance else "",
        max_waiting=deployment.setting("max_waiting"),
        wake_timeout_seconds=deployment.setting("wake_timeout_seconds"),
        fetched_at=time.monotonic(),
    )


class RoutingTable:
    """Routes by model name. A stale route is refreshed by ONE query while requests keep
    using it; ``fresh=True`` (after a wake) waits for the database's word."""

    def __init__(self) -> None:
        self._routes: dict[str, Route | None] = {}
        self._times: dict[str, float] = {}
        self._refreshing: dict[str, asyncio.Task[Route | None]] = {}

    async def _refresh(self, name: str) -> Route | None:
        try:
            route = await sync_to_async(_fetch, thread_sensitive=False)(name)
            self._routes[name] = route
            self._times[name] = time.monotonic()
            return route
        finally:
            self._refreshing.pop(name, None)

    async def get(self, name: str, *, fresh: bool = False) -> Route | None:
        age = time.monotonic() - self._times.get(name, -1e9)
        if not fresh and age <= SOFT_TTL_SECONDS:
            return self._routes[name]
        task = self._refreshing.get(name)
        if task is None:
            task = asyncio.ensure_future(self._refresh(name))
            self._refreshing[name] = task
        if not fresh and name in self._routes and age <= TTL_SECONDS:
            return self._routes[name]
        return await asyncio.shield(task)


def list_models() -> list[dict[str, object]]:
    """Every deployment, for ``GET /v1/models`` (filtered by the key by the caller)."""
    return [
        {
            "id": d.name,
            "pk": d.pk,
            "state": d.observed_state,
            "host": d.host.name if d.host else None,
            "created": int(d.created_at.timestamp()),
        }
        for d in Deployment.objects.select_related("host").order_by("name")
    ]
