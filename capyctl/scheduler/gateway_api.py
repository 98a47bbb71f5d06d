"""What the ``/v1`` gateway may use of the scheduler, and all of it (``tests/test_layout.py``
holds the gateway to this one module): make a model ready and wait for it, count a request
in flight, note that a model was asked for, the waits this process runs, the short Redis
calls of the request path, and the failures the gateway turns into answers.

Each function hands over to the module that does the work, looked up when called, so that
the work stays in one place (and a test that replaces it there replaces it here too).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

from django.conf import settings

from capyctl.deployments.models import Adapter, Deployment
from capyctl.events.services import record_event
from capyctl.scheduler import (
    actions,
    redislink,
    request_classes,
    requests_in_progress,
    routing,
    scaling,
    switches,
    turns,
    wakes,
)
from capyctl.scheduler.actions.adapters import AdapterNotInEngineError, AdaptersBusyError
from capyctl.scheduler.errors import (
    ControlPlaneUnavailableError,
    EngineFailedError,
    ModelStoppedError,
    NoCapacityError,
    SchedulerError,
    SourceError,
    WakeTimeoutError,
    is_control_plane_error,
    outage,
)
from capyctl.scheduler.redislink import Link
from capyctl.scheduler.routing import Homes as KeyHomes
from capyctl.scheduler.scaling import ReplicaView, Step
from capyctl.scheduler.turns import Wait

__all__ = [
    "OUTCOME_GRACE_SECONDS",
    "AdapterNotInEngineError",
    "AdaptersBusyError",
    "ControlPlaneUnavailableError",
    "EngineFailedError",
    "KeyHomes",
    "Link",
    "ModelStoppedError",
    "NoCapacityError",
    "ReplicaView",
    "SchedulerError",
    "SourceError",
    "Wait",
    "WakeTimeoutError",
    "adapter_loaded",
    "affinity_key",
    "begin_request",
    "bring_up",
    "class_begin",
    "class_end",
    "counts_shared",
    "end_request",
    "is_control_plane_error",
    "local_waits",
    "note_adapter_used",
    "note_asked_for",
    "outage",
    "ready",
    "redis_async_client",
    "redis_errors",
    "redis_link",
    "scale_step",
    "serving",
    "shared_counts",
]

# How much longer than the wake timeout a waiter listens, so that its answer carries the
# scheduler's reason rather than a bare timeout.
OUTCOME_GRACE_SECONDS = wakes.OUTCOME_GRACE_SECONDS


async def ready(
    deployment_id: int, timeout: float, wanted: Callable[[], bool] | None = None
) -> str:
    """Return once the deployment is ready; see :func:`capyctl.scheduler.wakes.ready`."""
    return await wakes.ready(deployment_id, timeout, wanted)


async def begin_request(deployment_id: int) -> bool:
    """Count a request in flight for the deployment, unless it drains (then ``False``)."""
    return await requests_in_progress.abegin(deployment_id)


async def end_request(deployment_id: int) -> None:
    """The request counted by :func:`begin_request` is over (its last byte sent)."""
    await requests_in_progress.aend(deployment_id)


def class_begin(deployment_id: int, batch: bool) -> None:
    """A request of that class (batch, or interactive) wants the deployment: it waits for
    it or is in flight on it (turns are decided on the classes: a dictionary's update)."""
    request_classes.begin(deployment_id, batch)


def class_end(deployment_id: int, batch: bool) -> None:
    """The request counted by :func:`class_begin` no longer wants the deployment."""
    request_classes.end(deployment_id, batch)


async def adapter_loaded(
    deployment_id: int, adapter_id: int, timeout: float
) -> tuple[str, float, int | None]:
    """Have the deployment's running engine hold the adapter (loaded now if it does not:
    one load however many requests ask, in this process); return what was switched for it
    (``loaded adapter a 52 ms``; empty when nothing was) and the seconds its load took
    (0 when none was needed), and its place in the launch's adapters where its engine
    names them so (llama-server; else None). Raises a SchedulerError when it
    cannot be (:class:`AdaptersBusyError`: every slot serves a request now)."""
    key = (deployment_id, adapter_id)
    running = _adapter_loads.get(key)
    if running is None:
        running = asyncio.ensure_future(
            wakes.run(_load_adapter, deployment_id, adapter_id, timeout)
        )
        _adapter_loads[key] = running
        running.add_done_callback(lambda _: _adapter_loads.pop(key, None))
    text, seconds, slot = await asyncio.shield(running)
    return str(text), float(seconds), slot


_adapter_loads: dict[tuple[int, int], asyncio.Future[Any]] = {}


def _load_adapter(
    deployment_id: int, adapter_id: int, timeout: float
) -> tuple[str, float, int | None]:
    name = Adapter.objects.filter(pk=adapter_id).values_list("name", flat=True).first() or ""
    loaded = actions.adapters.load(deployment_id, adapter_id, timeout)
    return loaded.describe(name), loaded.seconds, loaded.slot


def note_adapter_used(deployment_id: int, adapter_id: int) -> None:
    """Note a request of the adapter on the deployment's engine (least recently used)."""
    actions.adapters.note_used(deployment_id, adapter_id)


def counts_shared() -> bool:
    """Whether requests in flight are counted across processes (server mode, in Redis)."""
    return bool(settings.REDIS_URL)


async def shared_counts(deployment_ids: Sequence[int]) -> dict[int, int] | None:
    """Every process's requests in flight on each deployment (server mode), or None when
    they cannot be read now (Redis away, or its counts not yet to be trusted)."""
    return await wakes.run(_shared_counts, list(deployment_ids))  # type: ignore[no-any-return]


def _shared_counts(deployment_ids: list[int]) -> dict[int, int] | None:
    unknown: tuple[type[BaseException], ...] = (
        requests_in_progress.CountsUnknown,
        *redislink.errors(),
    )
    try:
        return {pk: requests_in_progress.count(pk) for pk in deployment_ids}
    except unknown:
        return None


def serving() -> None:
    """This process serves ``/v1`` (its requests in flight are the installation's, in
    standalone: reports read them here)."""
    requests_in_progress.serving()


def note_asked_for(deployment_id: int) -> None:
    """Note a request for the deployment (least-recently-used order), at most once a second."""
    actions.touch(deployment_id)


def local_waits() -> list[Wait]:
    """The waits this process runs itself (standalone: all of them)."""
    return turns.local_waits()


def switch_seconds(said: str) -> float:
    """What the steps of a switch (``x-capyctl-switch``) took in all."""
    return switches.seconds(said)


def redis_link(url: str) -> Link:
    """The quiet period of the Redis server at ``url`` (shared by the whole process)."""
    return redislink.link(url)


def redis_async_client(url: str) -> Any:
    """An asyncio Redis client with the request path's short timeouts."""
    return redislink.async_client(url)


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a Redis call raises when Redis does not answer."""
    return redislink.errors()


def affinity_key(headers: Any, body: Any) -> str | None:
    """What ties a request to a replica (:func:`capyctl.scheduler.routing.affinity_key`)."""
    return routing.affinity_key(headers, body)


def scale_step(
    replicas: Sequence[ReplicaView], demand: tuple[int, float], model: Any
) -> Step | None:
    """One more replica to bring up (:func:`capyctl.scheduler.scaling.decide`), or None.

    ``demand``: the requests whose answer has not begun, and the longest any has waited
    (seconds); ``model``: its route (``kept_up``, ``target_concurrency``,
    ``scale_up_wait_seconds``; as many replicas as ``replicas`` at most). Parking is left
    to the scheduler's pass (:mod:`capyctl.scheduler.replica_scaling`)."""
    bounds = scaling.Bounds(
        minimum=min(model.kept_up, len(replicas)),
        maximum=len(replicas),
        scale_up_wait_seconds=model.scale_up_wait_seconds or math.inf,
        target_concurrency=model.target_concurrency,
        idle_park_seconds=math.inf,
    )
    step = scaling.decide(replicas, scaling.Demand(*demand), bounds)
    return step if step is not None and step.action in (scaling.WAKE, scaling.START) else None


async def bring_up(step: Step, name: str, timeout: float) -> str:
    """Bring the replica of ``step`` up for the model ``name``: the step is an event with
    its reason and figures (``deployment.scaled``), then the replica is woken or started
    as a request's wait would."""
    if await wakes.run(_note_step, step, name):
        return await wakes.ready(step.replica_id, timeout)
    return ""


def _note_step(step: Step, name: str) -> bool:
    """Record the step, unless its replica is up already (the routes this process read
    were older than another's bring-up): whether to bring it up."""
    state = Deployment.objects.filter(pk=step.replica_id).values_list("observed_state", flat=True)
    if not state or state[0] in scaling.UP:
        return False
    record_event("deployment.scaled", f"{name}: {step.reason}", subject=name,
                 deployment_id=step.replica_id, data=dict(step.figures))  # fmt: skip
    return True
