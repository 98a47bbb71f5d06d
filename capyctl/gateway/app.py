"""The ``/v1`` ASGI app: authenticate, resolve, wait for a ready engine, forward.

Order of events (DESIGN §4): route (one allowlist, ``hostagent.routes``) → key → body
(bounded) → model → allowed? → desired state → ready, or wait in the model's bounded
queue while ONE wake runs → forward with the launch key, streaming the answer back
unbuffered. Every error is OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
import time
import uuid
from collections import OrderedDict
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

from capyctl.deployments import guards
from capyctl.errors import UserError
from capyctl.gateway import access, queueview
from capyctl.gateway.advice import with_capyctl_hint
from capyctl.gateway.batches import BatchedWrites
from capyctl.gateway.errors import GatewayError, invalid_key, model_not_found
from capyctl.gateway.keys import KeyCache, KeyInfo
from capyctl.gateway.queues import Place, Queues
from capyctl.gateway.routing import AGENT_PINS, Route, RoutingTable, list_models
from capyctl.gateway.upstream import UpstreamError, UpstreamPool
from capyctl.gateway.usage import UsageBook, UsageTap, make_limiter, write_usage
from capyctl.hosts.pki import pki
from capyctl.scheduler import gateway_api as scheduler
from capyctl.scheduler.gateway_api import (
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
from capyctl.traces.recording import TraceBook, TraceWriter
from capyctl.validation import validate_alias
from capyctl.web import metrics
from hostagent import routes
from hostagent.asgi import HOP_BY_HOP, cancel_on_disconnect
from hostagent.tls import client_context

logger = logging.getLogger("capyctl.gateway")

Scope = dict[str, Any]
# The client's key never reaches an engine: the instance's launch key replaces it. The
# engine's own date and server lines give way to the ones this server writes.
_HOP_BY_HOP = HOP_BY_HOP | {b"authorization", b"x-api-key", b"date", b"server"}
_NOT_FORWARDED = routes.NOT_FORWARDED | {b"authorization", b"x-api-key"}
_WHOLE_BODY_BYTES = 1024 * 1024  # sized answers up to this are passed on in one piece
_GATE_TRIES = 3  # waits for a wake when a drain closed the gate under a request
# The form's `model` part: its headers (non-empty lines) end at the first blank line.
_MULTIPART_MODEL = re.compile(rb'name="model"\r\n(?:[^\r\n]+\r\n)*?\r\n([^\r\n]*)\r\n')


class Gateway:
    def __init__(self) -> None:
        self.keys = KeyCache()
        self.routes = RoutingTable()
        self._upstream: UpstreamPool | None = None
        self._wakes: dict[int, asyncio.Future[str]] = {}
        self.queues = Queues()
        self._publisher: asyncio.Task[None] | None = None
        self._emptied: asyncio.Event | None = None  # the last waiting request left
        self._process = uuid.uuid4().hex  # this process, among those that publish queues
        self._touched: dict[int, float] = {}
        self.limits = make_limiter(settings.REDIS_URL)
        self.usage = UsageBook()
        self._usage_writes = BatchedWrites(self.usage, write_usage, "usage")
        self.traces = TraceBook()
        self._trace_writes = BatchedWrites(self.traces, TraceWriter(), "traces")
        # Read once: a settings lookup costs more than the rest of a request's trace.
        self._tracing = bool(settings.CAPYCTL["TRACE"])
        self.stored_responses = StoredResponses()
        self._tls: ssl.SSLContext | None = None
        self._stopping: asyncio.Future[None] | None = None  # set when the server stops

    # -- the ASGI entry point ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        started = time.perf_counter()
        outcome = _Outcome()
        try:
            await self._handle(scope, receive, send, started, outcome)
        except GatewayError as error:
            outcome.status, outcome.code = error.status, error.code
            await _respond(send, error.status, error.body(), error.response_headers())
        except Exception as exc:  # never a bare 500: an OpenAI-shaped answer, logged once
            # The path as a quoted literal: a client's text never shapes the log's lines.
            logger.exception("%s %r failed in the gateway", scope.get("method"), scope.get("path"))
            if outcome.headers_at:
                return  # the answer had begun: it ends here, and its client sees it cut
            failure = _failure(exc)
            outcome.status, outcome.code = failure.status, failure.code
            await _respond(send, failure.status, failure.body(), failure.response_headers())
        finally:
            if outcome.admitted is not None:
                await self.limits.leave(*outcome.admitted)
            metrics.count(outcome.model, outcome.status, started, outcome.headers_at,
                          outcome.overhead)  # fmt: skip
            key_id = outcome.admitted[0].key_id if outcome.admitted is not None else "-"
            access.log_request(scope["method"], outcome.path or access.quoted(scope["path"]),
                               started, model=outcome.model, status=outcome.status,
                               key_id=key_id)  # fmt: skip
            if self._tracing and outcome.admitted is not None and outcome.model != "-":
                self._trace(outcome, outcome.admitted[0].pk, started)

    def _trace(self, outcome: _Outcome, key_pk: int, started: float) -> None:
        """Note what the request came to, for ``capyctl trace export`` (a tuple appended;
        written within a second, off the request path)."""
        took = time.perf_counter() - started
        if outcome.headers_at:
            head_ms: float | None = (outcome.headers_at - started) * 1000
        else:  # an error answer goes out as the request ends; a client that left got none
            head_ms = None if outcome.status == 499 else took * 1000
        self.traces.add((time.time() - took, outcome.model, key_pk, outcome.stream,
                         outcome.status, outcome.code, outcome.queued_ms, head_ms, took * 1000,
                         outcome.prompt_tokens, outcome.completion_tokens,
                         outcome.switch))  # fmt: skip
        self._trace_writes.soon()

    async def _handle(
        self, scope: Scope, receive: Any, send: Any, started: float, outcome: _Outcome
    ) -> None:
        path = str(scope["path"])
        try:  # before anything else: only the documented routes, well formed
            target = routes.resolve(scope.get("raw_path") or path.encode(), path)
        except routes.RouteError as refused:
            raise GatewayError(refused.status, refused.code, refused.message, retry=False) from None
        outcome.path = target.path
        method = scope["method"]
        usual = method == "POST" and target.kind == "forward"  # two compares, most requests
        if not usual and method not in access.allowed_methods(target):
            raise access.method_not_allowed(method, target)
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        key = await self.keys.check(
            _presented_key(headers), scope.get("client"), scope.get("headers")
        )
        if key is None:
            raise invalid_key()
        # Per minute and in flight, the key's and its user's; released when __call__ ends.
        outcome.admitted = (key, await self.limits.admit(key))
        if target.kind == "models":
            await self._models(send, key, target.name)
            outcome.status = 200
            return
        body = await _read_body(receive, int(settings.CAPYCTL["MAX_BODY_BYTES"]))
        name, parsed = self._model_named(target, key, headers, body)
        outcome.stream = parsed is not None and parsed.get("stream") is True
        route = await self.routes.get(name)
        if route is None or not key.allows(route.deployment_id):
            raise model_not_found(name)
        outcome.model = route.name  # a label only once it names a model the key may use
        if route.desired_state == "stopped":
            raise GatewayError(
                503, "model_stopped", f"The model `{name}` is stopped.", "server_error", False
            )
        if route.host_state == "unreachable":
            raise GatewayError(
                503,
                "host_unreachable",
                f"The host of `{name}` ({route.host}) does not answer; retry when it is back.",
                "server_error",
            )
        _check_guards(parsed, body, route)  # what it asks of the engine
        if name != route.name:  # an alias: the engine serves the deployment's own name
            body = _rename_model(body, parsed, route.name)
        waits = route.observed_state != "ready" or route.base_url is None
        if waits and outcome.stream:
            # A stream that waits gets its head and comment lines meanwhile (see _KeepAlive).
            keepalive = _KeepAlive(send, route, self.routes, outcome)
            try:
                await self._admit_and_forward(scope, receive, keepalive.send, key=key,
                                              headers=headers, body=body, route=route,
                                              target=target, started=started, outcome=outcome,
                                              keepalive=keepalive)  # fmt: skip
            except Exception as exc:
                if not await keepalive.stop():
                    raise  # nothing was sent yet: an ordinary error answer
                await keepalive.fail(exc, f"{scope.get('method')} {path!r}")
            finally:
                await keepalive.stop()
            return
        await self._admit_and_forward(scope, receive, send, key=key, headers=headers, body=body,
                                      route=route, target=target, started=started,
                                      outcome=outcome)  # fmt: skip

    async def _admit_and_forward(
        self,
        scope: Scope,
        receive: Any,
        send: Any,
        *,
        key: KeyInfo,
        headers: dict[bytes, bytes],
        body: bytes,
        route: Route,
        target: routes.Target,
        started: float,
        outcome: _Outcome,
        keepalive: _KeepAlive | None = None,
    ) -> None:
        try:
            route = await self._admit(route, receive, key.pk, outcome)
        except _ClientGone:  # it left the queue, and counts for nothing
            outcome.status = 499
            return
        waited_ms = outcome.queued_ms
        try:
            if keepalive is not None:
                await keepalive.stop()  # no more comment lines: the answer follows
            if waited_ms:
                metrics.WAITS.observe(route.name, waited_ms / 1000)
            await self._forward(
                scope,
                receive,
                send,
                key=key,
                headers=headers,
                body=body,
                route=route,
                target=target,
                started=started,
                waited_ms=waited_ms,
                outcome=outcome,
            )
        finally:
            await scheduler.end_request(route.deployment_id)
            self._touch(route.deployment_id)  # idleness counts from a request's end

    def _model_named(
        self, target: routes.Target, key: KeyInfo, headers: dict[bytes, bytes], body: bytes
    ) -> tuple[str, dict[str, Any] | None]:
        """The model a request is for, and its parsed JSON body (when it has one)."""
        if target.kind != "stored":
            name, parsed = _model_of(headers.get(b"content-type", b""), body)
            try:  # a name no deployment can have is not looked up
                validate_alias(name)
            except UserError:
                raise model_not_found(name[:128]) from None
            return name, parsed
        # GET /v1/responses/{id}, …/cancel: no body names the model; its maker does. Only
        # its maker's keys see it: another user gets the answer an unknown id gets.
        maker = self.stored_responses.get(str(target.name), key.user_id)
        if maker is None:
            raise GatewayError(
                404,
                "response_not_found",
                f"No response `{target.name}` was made through this endpoint.",
                retry=False,
            )
        return maker, None

    async def _admit(self, route: Route, receive: Any, key: int, outcome: _Outcome) -> Route:
        """Count the request in flight on a ready engine, waiting for a wake if needed;
        returns the route to use, and notes in ``outcome`` the milliseconds waited and
        what the wake switched. A client that goes away while it waits leaves the queue at
        once (:class:`_ClientGone`)."""
        ready = route.observed_state == "ready" and route.base_url is not None
        for _ in range(_GATE_TRIES):
            if not ready:
                wait_started = time.perf_counter()
                try:
                    route, switch = await self._wait_or_leave(route, receive, key)
                    outcome.switch = switch or outcome.switch
                except GatewayError as refused:  # it says how long it waited, too
                    waited_ms = outcome.queued_ms + (time.perf_counter() - wait_started) * 1000
                    refused.headers.append((b"x-capyctl-queued-ms", f"{waited_ms:.0f}".encode()))
                    raise
                finally:  # served, refused or left: its trace says how long it waited
                    outcome.queued_ms += (time.perf_counter() - wait_started) * 1000
            if await scheduler.begin_request(route.deployment_id):
                return route
            ready = False  # it began draining after our route was read: wait for the wake
        raise GatewayError(
            503,
            "unavailable",
            f"`{route.name}` is being switched over and over; retry shortly.",
            "server_error",
            headers=[(b"retry-after", b"1")],
        )

    # -- /v1/models --------------------------------------------------------------------------

    async def _models(self, send: Any, key: KeyInfo, one: str | None) -> None:
        """``GET /v1/models`` (the list) or ``GET /v1/models/{name}`` (one of it)."""
        models = await sync_to_async(list_models, thread_sensitive=False)()
        data = [
            {
                "id": m["id"],
                "object": "model",
                "created": m["created"],
                "owned_by": "capyctl",
                "state": m["state"],
                "host": m["host"],
                # requests this process holds waiting for it to be started or woken
                "waiting": self.queues.count(int(str(m["pk"]))),
            }
            for m in models
            if key.allows(int(str(m["pk"])))
        ]
        if one is not None:
            found = [m for m in data if m["id"] == one]
            if not found:
                raise model_not_found(one)
            body = json.dumps(found[0]).encode()
        else:
            body = json.dumps({"object": "list", "data": data}).encode()
        await _respond(send, 200, body, [(b"content-type", b"application/json")])

    # -- waiting for a wake --------------------------------------------------------------------

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

    async def _wait_or_leave(self, route: Route, receive: Any, key: int) -> tuple[Route, str]:
        """:meth:`_wait_ready`, unless the client goes away first: then its place in the
        queue is given up at once (the wake it asked for goes on for the others)."""
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
            raise _ClientGone
        return waiting.result()  # done (even if it left just then: _forward sees that)

    async def _wait_ready(self, route: Route, key: int) -> tuple[Route, str]:
        deployment_id = route.deployment_id
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
                raise _scheduler_error(exc, route) from exc
        finally:
            self.queues.leave(deployment_id, place)
            metrics.NOW.note_waiting(route.name, self.queues.count(deployment_id))
            if self._emptied is not None and not any(metrics.NOW.waiting.values()):
                self._emptied.set()  # said at once, not at the next second
        fresh = await self.routes.get(route.name, fresh=True)
        if fresh is None or fresh.base_url is None:
            raise GatewayError(
                503, "engine_failed", f"`{route.name}` is not running.", "server_error"
            )
        return fresh, switch

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

    # -- forwarding ------------------------------------------------------------------------------

    def _agent_tls(self) -> ssl.SSLContext:
        if self._tls is None:
            where = pki()
            self._tls = client_context(
                where.ca_cert, where.server_cert, where.server_key, pins=AGENT_PINS
            )
        return self._tls

    async def close(self) -> None:
        """Write the usage and traces not written yet, and close the connections to
        engines (at shutdown)."""
        await self._usage_writes.close()
        await self._trace_writes.close()
        if self._upstream is not None:
            await self._upstream.close()
        await self.limits.close()
        await self.keys.close()
        await self.routes.close()

    def _client(self) -> UpstreamPool:
        if self._upstream is None or self._upstream.closed:
            self._upstream = UpstreamPool()
        return self._upstream

    async def _forward(
        self,
        scope: Scope,
        receive: Any,
        send: Any,
        *,
        key: KeyInfo,
        headers: dict[bytes, bytes],
        body: bytes,
        route: Route,
        target: routes.Target,
        started: float,
        waited_ms: float,
        outcome: _Outcome,
    ) -> None:
        upstream_headers = routes.forwarded_headers(headers, _NOT_FORWARDED)
        upstream_headers.append((b"authorization", f"Bearer {route.launch_key}".encode()))
        # The route's own path, never the client's text: nothing for a parser to re-read.
        url = f"{route.base_url}{target.path}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        self._touch(route.deployment_id)
        want_id = scope["method"] == "POST" and target.path == routes.RESPONSES
        tap = UsageTap(want_response_id=want_id)
        # The answer streams in this task; a watcher cancels it if the client goes away, so
        # the engine stops generating for no one (one extra task a request, no more).
        this = cast("asyncio.Task[None]", asyncio.current_task())
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(cancel_on_disconnect(receive, this, gone))
        try:
            await self._stream(
                scope["method"],
                url,
                tls_name=route.tls_name,
                tap=tap,
                outcome=outcome,
                headers=upstream_headers,
                body=body,
                send=send,
                started=started,
                waited_ms=waited_ms,
            )
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # cancelled for another reason (shutdown): not ours to swallow
            this.uncancel()
        finally:
            watcher.cancel()
            if tap.response_id is not None:
                self.stored_responses.put(tap.response_id, route.name, key.user_id)
            outcome.prompt_tokens, outcome.completion_tokens = tap.tokens()
            self.usage.add(key.pk, outcome.prompt_tokens, outcome.completion_tokens)
            self._usage_writes.soon()

    async def _stream(
        self,
        method: str,
        url: str,
        *,
        tls_name: str | None,
        tap: UsageTap,
        outcome: _Outcome,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        send: Any,
        started: float,
        waited_ms: float,
    ) -> None:
        sent_headers = False
        try:
            # A remote host's relay: mutual TLS, its certificate checked for its name.
            tls = self._agent_tls() if tls_name is not None else None
            upstream = await self._client().request(
                method, url, headers, body, ssl_context=tls, server_hostname=tls_name
            )
            # Closed before its end (an error, a client gone), its connection is closed,
            # so the engine stops generating; ended cleanly, it is kept for the next.
            async with upstream:
                out = [(k, v) for k, v in upstream.raw_headers if k.lower() not in _HOP_BY_HOP]
                outcome.status = upstream.status
                outcome.headers_at = time.perf_counter()
                overhead = (outcome.headers_at - started) * 1000 - waited_ms
                outcome.overhead = overhead / 1000
                out.append((b"x-capyctl-overhead-ms", f"{overhead:.1f}".encode()))
                out.append((b"x-capyctl-queued-ms", f"{waited_ms:.0f}".encode()))
                if outcome.switch:
                    out.append((b"x-capyctl-switch", outcome.switch.encode()))
                length = upstream.content_length
                if length is not None and length <= _WHOLE_BODY_BYTES:
                    # A sized answer (not a stream): read it, then pass it on with its
                    # length in one write, instead of chunk, chunk and end-of-chunks.
                    whole = await upstream.read()
                    if upstream.status >= 400:  # an engine's advice, said as CapyCTL takes it
                        whole = with_capyctl_hint(whole, outcome.model)
                    tap.feed(whole)
                    out.append((b"content-length", str(len(whole)).encode()))
                    await send(
                        {"type": "http.response.start", "status": upstream.status, "headers": out}
                    )
                    sent_headers = True
                    await send({"type": "http.response.body", "body": whole})
                    return
                await send(
                    {"type": "http.response.start", "status": upstream.status, "headers": out}
                )
                sent_headers = True
                async for chunk in upstream.iter_chunks():
                    tap.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as exc:
            # The log keeps where it failed; the client learns no internal address.
            logger.warning("%s %s: the engine did not answer: %s", method, url, exc)
            message = "The model's engine did not answer or broke off its answer."
            if not sent_headers:
                raise GatewayError(502, "engine_failed", message, "server_error") from exc
            error = GatewayError(502, "engine_failed", message, "server_error")
            outcome.code = error.code  # the answer ends with this error's line
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + error.body() + b"\n\n",
                    "more_body": False,
                }
            )

    def _touch(self, deployment_id: int) -> None:
        now = time.monotonic()
        if now - self._touched.get(deployment_id, 0.0) >= 1.0:
            self._touched[deployment_id] = now
            asyncio.get_running_loop().run_in_executor(None, _touch_sync, deployment_id)


def _control_plane_down(message: str, retry_after: int = 1) -> GatewayError:
    return GatewayError(
        503,
        "control_plane_unavailable",
        message,
        "server_error",
        headers=[(b"retry-after", str(retry_after).encode())],
    )


def _failure(exc: Exception) -> GatewayError:
    """The answer for an unexpected failure: 503 ``control_plane_unavailable`` when the
    database or Redis did not answer (a retry soon may succeed), else 500
    ``internal_error``."""
    if is_control_plane_error(exc):
        told = outage(exc)
        return _control_plane_down(told.message, told.retry_after)
    return GatewayError(
        500, "internal_error", "CapyCTL failed to handle this request; it was logged.",
        "server_error",
    )  # fmt: skip


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


def _scheduler_error(exc: SchedulerError, route: Route) -> GatewayError:
    """The /v1 error for a wake that failed with the scheduler's error ``exc``."""
    message = str(exc)
    if isinstance(exc, WakeTimeoutError):
        waited_for_room = "waits for room" in message  # the scheduler's, not a deadline's
        return _wake_timeout(route, message if waited_for_room else "")
    if isinstance(exc, ControlPlaneUnavailableError):
        return _control_plane_down(message)
    for kind, status, retry in _SCHEDULER_ANSWERS:
        if isinstance(exc, kind):
            return GatewayError(status, kind.code, message, "server_error", retry)
    return GatewayError(503, "unavailable", message, "server_error")


def _touch_sync(deployment_id: int) -> None:
    try:
        scheduler.note_asked_for(deployment_id)
    except Exception as exc:  # idleness only: the next request touches it again
        logger.debug("could not note a request's end on %s: %s", deployment_id, exc)
    finally:
        connection.close()


class _ClientGone(Exception):  # noqa: N818 - not an error: the client left
    """The client went away while its request waited."""


async def _disconnected(receive: Any) -> None:
    """Return once the client has gone away (its body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _KeepAlive:
    """A streaming request waiting for its model: once it has waited STREAM_KEEPALIVE
    seconds, its answer's head is sent (200, an SSE stream) and then an SSE comment line
    (``: waiting for b: waking, 12.0 s``) every as many seconds, so proxies that cut idle
    connections (Cloudflare at about 100 s) and clients with a read timeout keep it. Once
    the head went out, :meth:`send` passes the engine's answer on without its own head (an
    engine's error answer becomes the stream's ``data: {"error": …}`` line), and a
    failure of the wait ends the stream with that line too. A wait shorter than the
    interval sends nothing of its own: the answer is as any other."""

    def __init__(self, send: Any, route: Route, routes: RoutingTable, outcome: _Outcome) -> None:
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

    async def fail(self, exc: Exception, what: str) -> None:
        """End the stream whose head went out with the error's line (an unexpected one
        logged once), not cut."""
        if isinstance(exc, GatewayError):
            error = exc
        else:
            logger.error("%s failed in the gateway", what, exc_info=exc)
            error = _failure(exc)
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


class _Outcome:
    """What one request came to, for the metrics and its trace."""

    __slots__ = ("admitted", "code", "completion_tokens", "headers_at", "model", "overhead",
                 "path", "prompt_tokens", "queued_ms", "status", "stream", "switch")  # fmt: skip

    def __init__(self) -> None:
        self.admitted: tuple[KeyInfo, str | None] | None = None  # a key and its in-flight token
        self.model = "-"  # no model label for requests refused before one was resolved
        self.path = ""  # the route's own path, once the path was found to be one
        self.status = 500
        self.code: str | None = None  # an error answer's code
        self.stream = False  # the body asked for a stream
        self.headers_at = 0.0
        self.overhead = 0.0
        self.queued_ms = 0.0  # waiting for a start or wake
        self.switch = ""  # what the wake it waited for switched (x-capyctl-switch)
        self.prompt_tokens = 0
        self.completion_tokens = 0


class StoredResponses:
    """Which model made each stored response (``resp_…``), and for which user, so that
    ``GET /v1/responses/{id}`` and its sub-paths, which name no model, reach the same
    engine, for that user's keys only. The newest ``limit`` ids are kept."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._models: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def put(self, response_id: str, model: str, user_id: int) -> None:
        self._models[response_id] = (model, user_id)
        self._models.move_to_end(response_id)
        while len(self._models) > self.limit:
            self._models.popitem(last=False)

    def get(self, response_id: str, user_id: int) -> str | None:
        """The model, if ``user_id`` made the response."""
        found = self._models.get(response_id)
        return found[0] if found is not None and found[1] == user_id else None


def _presented_key(headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(400, "client_disconnected", "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                413, "request_too_large", f"The request body is larger than {limit} bytes."
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _model_of(content_type: bytes, body: bytes) -> tuple[str, dict[str, Any] | None]:
    """The model a request names, and its parsed JSON body (None for a multipart form)."""
    if content_type.startswith(b"multipart/form-data"):
        match = _MULTIPART_MODEL.search(body)
        if match is None:
            raise GatewayError(400, "invalid_request_error", "The form has no `model` field.")
        return match.group(1).decode("utf-8", "replace"), None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GatewayError(
            400, "invalid_request_error", "The request body is not valid JSON."
        ) from None
    except RecursionError:  # the C parser's own bound on nesting
        raise GatewayError(
            400, "invalid_request_error", "The request body is nested too deeply."
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        raise GatewayError(400, "invalid_request_error", "The request needs a `model` string.")
    return str(data["model"]), data


def _check_guards(parsed: dict[str, Any] | None, body: bytes, route: Route) -> None:
    """400 naming the field for a count past the route's ceiling, or a media URL outside
    its policy (:mod:`capyctl.deployments.guards`), in a JSON body."""
    if parsed is None:  # a form (audio uploads): no counts, no URLs
        return
    try:
        guards.check_ceilings(parsed, route.ceilings)
        if guards.may_mention_url(body):  # most bodies name no URL: not walked
            guards.check_media(parsed, route.media_domains)
    except guards.RequestRefusedError as refused:
        raise GatewayError(
            400, refused.code, refused.message, retry=False, param=refused.param
        ) from None


def _rename_model(body: bytes, parsed: dict[str, Any] | None, served_name: str) -> bytes:
    if parsed is not None:
        return json.dumps({**parsed, "model": served_name}).encode()
    match = _MULTIPART_MODEL.search(body)
    if match is None:
        return body
    return body[: match.start(1)] + served_name.encode() + body[match.end(1) :]


async def _respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


gateway = Gateway()
