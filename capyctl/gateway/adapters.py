"""Requests for adapters: each is served by its base's engine, under the name that engine
knows the adapter by (:func:`request_body`), once the engine holds it (:func:`load`: a
load shared by every request that waits for it, and counted while the request is in
flight, so that no load unloads an adapter serving a request).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from capyctl.gateway.context import RequestContext
from capyctl.gateway.errors import GatewayError
from capyctl.gateway.routing import AdapterRef, Route
from capyctl.gateway.waiting import scheduler_error
from capyctl.scheduler import gateway_api as scheduler
from capyctl.web import metrics
from hostagent.kinds.adapters import adapter_request_fields

logger = logging.getLogger("capyctl.gateway")


def request_body(
    body: bytes, parsed: dict[str, Any] | None, route: Route, adapter: AdapterRef, slot: int = 0
) -> bytes:
    """``body`` as the base's engine (of ``route``) takes a request for ``adapter`` (``slot``:
    its place in the engine's launch, for an engine that names adapters by it)."""
    fields = adapter_request_fields(route.kind, route.name, adapter.name, slot)
    if parsed is None:  # a form names the model only: the engine's name for the adapter
        raise GatewayError(
            400, "invalid_request_error", f"`{adapter.name}` is an adapter: send JSON to it."
        )
    return json.dumps({**parsed, **fields}).encode()


async def begin(adapter: AdapterRef) -> None:
    """Count a request in flight on ``adapter`` (before its load: a load for another
    adapter then leaves it alone)."""
    await scheduler.begin_request(adapter.ref)


async def end(ctx: RequestContext, adapter: AdapterRef) -> None:
    await scheduler.end_request(adapter.ref)
    try:
        await asyncio.to_thread(scheduler.note_adapter_used, ctx.route.deployment_id,
                                adapter.pk)  # fmt: skip
    except Exception as exc:  # least-recently-used order only: the next request notes it
        logger.debug("could not note a request of %s: %s", adapter.name, exc)


async def load(ctx: RequestContext, adapter: AdapterRef) -> None:
    """Have the engine of ``ctx.route`` hold ``adapter``; what a load switched goes into
    ``x-capyctl-switch``."""
    route = ctx.route
    try:
        switched, seconds, slot = await scheduler.adapter_loaded(
            route.deployment_id, adapter.pk, float(route.max_queue_seconds)
        )
    except (scheduler.AdaptersBusyError, scheduler.AdapterNotInEngineError) as busy:
        wait = b"1" if isinstance(busy, scheduler.AdaptersBusyError) else b"5"
        raise GatewayError(503, busy.code, str(busy), "server_error",
                           headers=[(b"retry-after", wait)]) from busy  # fmt: skip
    except scheduler.SchedulerError as exc:
        raise scheduler_error(exc, route) from exc
    if slot is not None:  # named by its place in the launch's adapters (llama-server)
        ctx.body = request_body(ctx.body, json.loads(ctx.body), route, adapter, slot)
    if switched:
        metrics.ADAPTER_LOADS.observe(adapter.name, seconds)
        outcome = ctx.outcome
        outcome.switch = f"{outcome.switch}; {switched}" if outcome.switch else switched
