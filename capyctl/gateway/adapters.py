"""Requests for adapters: each is served by its base's engine, under the name that engine
knows the adapter by (:func:`request_body`), once the engine holds it (:func:`load`: a
load shared by every request that waits for it, and counted while the request is in
flight, so that no load unloads an adapter serving a request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from django.db import connection

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
    """The request of ``adapter`` ended: counted no more, and noted (least recently used
    order) off the event loop, without waiting for it."""
    await scheduler.end_request(adapter.ref)
    asyncio.get_running_loop().run_in_executor(
        None, _note_used, ctx.route.deployment_id, adapter.pk, adapter.name
    )


def _note_used(deployment_id: int, adapter_id: int, name: str) -> None:
    try:
        scheduler.note_adapter_used(deployment_id, adapter_id)
    except Exception as exc:  # least-recently-used order only: the next request notes it
        logger.debug("could not note a request of %s: %s", name, exc)
    finally:
        connection.close()


# Adapters this process saw held by an engine: (deployment, adapter, the engine's launch
# key) -> (when, its slot). A request finds its adapter here without a database read or a
# thread; seen more than KNOWN_SECONDS ago, after a wait (a wake or a start: a deep park
# drops adapters), or after this process unloaded one of the engine's, it is asked again.
KNOWN_SECONDS = 1.0
KNOWN_MAX = 10_000
_known: dict[tuple[int, int, str], tuple[float, int | None]] = {}


async def load(ctx: RequestContext, adapter: AdapterRef) -> None:
    """Have the engine of ``ctx.route`` hold ``adapter``; what a load switched goes into
    ``x-capyctl-switch``."""
    route = ctx.route
    key = (route.deployment_id, adapter.pk, route.launch_key)
    known = _known.get(key)
    waited = ctx.outcome.queued_ms > 0 or bool(ctx.outcome.switch)
    if known is not None and not waited and time.monotonic() - known[0] < KNOWN_SECONDS:
        if known[1] is not None:
            ctx.body = request_body(ctx.body, json.loads(ctx.body), route, adapter, known[1])
        return
    began = time.perf_counter()
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
    finally:  # waiting for a load is waiting, not CapyCTL's own time
        ctx.outcome.queued_ms += (time.perf_counter() - began) * 1000
    if switched and "unloaded adapter" in switched:  # what else it knew of this engine
        for other in [k for k in _known if k[0] == route.deployment_id]:
            del _known[other]
    if len(_known) >= KNOWN_MAX:
        _known.clear()
    _known[key] = (time.monotonic(), slot)
    if slot is not None:  # named by its place in the launch's adapters (llama-server)
        ctx.body = request_body(ctx.body, json.loads(ctx.body), route, adapter, slot)
    if switched:
        metrics.ADAPTER_LOADS.observe(adapter.name, seconds)
        outcome = ctx.outcome
        outcome.switch = f"{outcome.switch}; {switched}" if outcome.switch else switched
