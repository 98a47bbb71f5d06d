"""Waiting for a model to be ready: :class:`Waiting` (each model's bounded queue, ONE wake
per model however many requests wait for it, the queues published for ``capyctl status``),
:class:`KeepAlive` (the comment lines a waiting stream gets), and the scheduler's errors
as ``/v1`` answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from django.conf import settings

from capyctl.gateway import queueview
from capyctl.gateway.context import Outcome
from capyctl.gateway.cost import SwitchCost
from capyctl.gateway.errors import GatewayError, control_plane_down
from capyctl.gateway.queues import Place, Queues
from capyctl.gateway.routing import Route, RoutingTable
from capyctl.scheduler import gateway_api as scheduler
from capyctl.scheduler.gateway_api import (
    ControlPlaneUnavailableError,
    EngineFailedError,
    ModelStoppedError,
    NoCapacityError,
    SchedulerError,
    SourceError,
    WakeTimeoutError,
)
from capyctl.web import metrics

logger = logging.getLogger("capyctl.gateway")


class ClientGone(Exception):  # noqa: N818 - not an error: the client left
    """The client went away while its request waited."""


class Waiting:
    """The requests of this process that wait for a model to be started or woken."""

    def __init__(self, routes: RoutingTable) -> None:
        self.routes = routes
        self.queues = Queues()
        self._wakes: dict[int, asyncio.Future[str]] = {}
        self._switch_costs: dict[int, SwitchCost] = {}  # each wake's, for those waiting
        self._publisher: asyncio.Task[None] | None = None
        self._emptied: asyncio.Event | None = None  # the last waiting request left
        self._process = uuid.uuid4().hex  # this process, among those that publish queues
        self._stopping: asyncio.Future[None] | None = None  # set when the server stops

    def stopping(self) -> None:
        """The server is stopping: requests waiting for a wake are answered now (503, retry)
        rather than cut when it exits; a wake under way goes on without them."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        if not self._stopping.done():
            self._stopping.set_result(None)

    async def _unless_stopping(self, waiting: Any, place: Place) -> str:
        """``waiting``'s outcome, unless the server stops or another key takes the place
        first."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(waiting)
        try:
            await asyncio.wait([task, self._stopping, place.given_up],
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            if not task.done():  # this request left (or the server stops): no orphan
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():
            return str(task.result() or "")  # its outcome, or its error
        if place.given_up.done():
            raise GatewayError(
                429,
                "queue_full",
                "Too many requests are waiting for this model; this key's newest gave its "
                "place to another key's. Retry shortly.",
                "rate_limit_error",
                headers=[(b"retry-after", b"1")],
            )
        raise GatewayError(
            503,
            "unavailable",
            "CapyCTL is restarting; retry shortly.",
            "server_error",
            headers=[(b"retry-after", b"1")],
        )

    async def wait_or_leave(self, route: Route, receive: Any, key: int) -> tuple[Route, str, float]:
        """:meth:`_wait_ready`, unless the client goes away first: then its place in the
        queue is given up at once (the wake it asked for goes on for the others). Returns
        the route made ready, what its wake switched, and this request's share of the
        wake's GPU-seconds (:mod:`capyctl.gateway.cost`)."""
        waiting = asyncio.ensure_future(self._wait_ready(route, key))
        leaving = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({waiting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():
                waiting.cancel()
            leaving.cancel()
            await asyncio.gather(waiting, leaving, return_exceptions=True)
        if waiting.cancelled():  # it left first: its place is given back
            raise ClientGone
        return waiting.result()  # done (even if it left just then: forwarding sees that)

    async def _wait_ready(self, route: Route, key: int) -> tuple[Route, str, float]:
        deployment_id = route.deployment_id
        cost: SwitchCost | None = None
        shared = False
        place = self.queues.join(deployment_id, key, route.max_waiting)
        if place is None:
            raise GatewayError(
                429,
                "queue_full",
                f"Too many requests are waiting for `{route.name}`; retry shortly.",
                "rate_limit_error",
                headers=[(b"retry-after", b"1")],
            )
        metrics.NOW.note_waiting(route.name, self.queues.count(deployment_id))
        if self._publisher is None or self._publisher.done():
            self._emptied = asyncio.Event()
            self._publisher = asyncio.ensure_future(self._publish_queues(self._emptied))
        try:
            wake = self._wakes.get(deployment_id)
            if wake is None or wake.done():
                # One wake per model, however many requests wait for it.
                wanted = lambda: self.queues.count(deployment_id) > 0  # noqa: E731
                wake = asyncio.ensure_future(
                    scheduler.ready(deployment_id, route.max_queue_seconds, wanted)
                )
                self._wakes[deployment_id] = wake
                self._switch_costs[deployment_id] = SwitchCost()
            cost = self._switch_costs[deployment_id]
            cost.sharing += 1
            try:
                switch = await self._unless_stopping(
                    asyncio.wait_for(
                        asyncio.shield(wake),
                        timeout=route.max_queue_seconds + scheduler.OUTCOME_GRACE_SECONDS,
                    ),
                    place,
                )
            except TimeoutError:
                raise _wake_timeout(route) from None
            except SchedulerError as exc:
                raise scheduler_error(exc, route) from exc
            shared = True
        finally:
            if not shared and cost is not None:  # it left, or the wake failed: not charged
                cost.sharing -= 1
            self.queues.leave(deployment_id, place)
            metrics.NOW.note_waiting(route.name, self.queues.count(deployment_id))
            if self._emptied is not None and not any(metrics.NOW.waiting.values()):
                self._emptied.set()  # said at once, not at the next second
        fresh = await self.routes.get(route.name, fresh=True)
        if fresh is None or fresh.base_url is None:
            raise GatewayError(
                503, "engine_failed", f"`{route.name}` is not running.", "server_error"
            )
        spent = scheduler.switch_seconds(switch) if switch else 0.0
        return fresh, switch, cost.share(spent, len(fresh.gpus)) if cost is not None else 0.0

    async def _publish_queues(self, emptied: asyncio.Event) -> None:
        """While requests wait, say so to other processes (``capyctl status``) every
        second, and once more as soon as none does (:mod:`capyctl.gateway.queueview`)."""
        while True:
            emptied.clear()
            view: dict[str, dict[str, Any]] = {
                name: {"waiting": count, "room_since": None}
                for name, count in metrics.NOW.waiting.items()
                if count > 0
            }
            for wait in scheduler.local_waits():
                view.setdefault(wait.name, {"waiting": 0, "room_since": None})
                view[wait.name].update(room_since=wait.since, host_id=wait.host_id,
                                       pools=list(wait.pools))  # fmt: skip
            try:
                await asyncio.to_thread(queueview.publish, view, self._process)
            except Exception as exc:  # a status line only: the next second tries again
                logger.debug("could not publish the queues: %s", exc)
            if not view:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(emptied.wait(), queueview.PUBLISH_SECONDS)


def _wake_timeout(route: Route, why: str = "") -> GatewayError:
    """504 ``wake_timeout``; ``why``: what it waited for (room that did not come free)."""
    return GatewayError(
        504,
        "wake_timeout",
        f"`{route.name}` did not become ready within {route.max_queue_seconds}s"
        + (f": {why}" if why else "."),
        "server_error",
        headers=[(b"retry-after", b"1")],
    )


# The scheduler's errors as /v1 answers: status, and whether a retry may help.
_SCHEDULER_ANSWERS: tuple[tuple[type[SchedulerError], int, bool], ...] = (
    (NoCapacityError, 503, False),
    (ModelStoppedError, 503, False),
    (EngineFailedError, 502, True),
    (SourceError, 502, False),  # weights missing or their download failed
)


def scheduler_error(exc: SchedulerError, route: Route) -> GatewayError:
    """The /v1 error for a wake that failed with the scheduler's error ``exc``."""
    message = str(exc)
    if isinstance(exc, WakeTimeoutError):
        waited_for_room = "waits for room" in message  # the scheduler's, not a deadline's
        return _wake_timeout(route, message if waited_for_room else "")
    if isinstance(exc, ControlPlaneUnavailableError):
        return control_plane_down(message)
    for kind, status, retry in _SCHEDULER_ANSWERS:
        if isinstance(exc, kind):
            return GatewayError(status, kind.code, message, "server_error", retry)
    return GatewayError(503, "unavailable", message, "server_error")


async def _disconnected(receive: Any) -> None:
    """Return once the client has gone away (its body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class KeepAlive:
    """A streaming request waiting for its model: once it has waited STREAM_KEEPALIVE
    seconds, its answer's head is sent (200, an SSE stream) and then an SSE comment line
    (``: waiting for b: waking, 12.0 s``) every as many seconds, so proxies that cut idle
    connections (Cloudflare at about 100 s) and clients with a read timeout keep it. Once
    the head went out, :meth:`send` passes the engine's answer on without its own head (an
    engine's error answer becomes the stream's ``data: {"error": …}`` line), and a
    failure of the wait ends the stream with that line too. A wait shorter than the
    interval sends nothing of its own: the answer is as any other."""

    def __init__(self, send: Any, route: Route, routes: RoutingTable, outcome: Outcome) -> None:
        self._send = send
        self._route = route
        self._routes = routes
        self._outcome = outcome
        self._since = time.monotonic()
        self._status = 200
        self._error = b""
        self.started = False
        self._ticking: asyncio.Task[None] | None = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        every = float(settings.CAPYCTL["STREAM_KEEPALIVE_SECONDS"])
        while True:
            await asyncio.sleep(every)
            if not self.started:
                self.started = True
                self._outcome.headers_at = time.perf_counter()
                await self._send(
                    {"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                    ]}
                )  # fmt: skip
            route = await self._routes.get(self._route.name)
            state = route.observed_state if route is not None else "gone"
            waited = time.monotonic() - self._since
            line = f": waiting for {self._route.name}: {state}, {waited:.1f} s\n\n"
            await self._send({"type": "http.response.body", "body": line.encode(),
                              "more_body": True})  # fmt: skip

    async def stop(self) -> bool:
        """No more comment lines; whether the head was sent."""
        ticking, self._ticking = self._ticking, None
        if ticking is not None:
            ticking.cancel()
            await asyncio.wait({ticking})  # its end, whatever it was: never raised here
            if not ticking.cancelled() and ticking.exception() is not None:
                logger.warning("keep-alive lines stopped: %s", ticking.exception())
        return self.started

    async def fail(self, error: GatewayError) -> None:
        """End the stream whose head went out with the error's line, not cut."""
        self._outcome.status, self._outcome.code = error.status, error.code
        await self.end_with(error.body())

    async def end_with(self, error: bytes) -> None:
        await self._send({"type": "http.response.body", "body": b"data: " + error + b"\n\n",
                          "more_body": False})  # fmt: skip

    async def send(self, message: dict[str, Any]) -> None:
        if not self.started:
            await self._send(message)
            return
        if message["type"] == "http.response.start":  # the head went out already
            self._status = int(message["status"])
            return
        if self._status < 400:
            await self._send(message)
            return
        self._error += message.get("body", b"")  # an engine's refusal: as the error line
        if not message.get("more_body", False):
            await self.end_with(self._error.strip())
