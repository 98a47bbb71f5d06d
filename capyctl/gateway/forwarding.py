"""Forwarding: :class:`Forwarding` sends an admitted request to its engine (or its host's
relay, over mutual TLS) with the launch key in place of the client's, streams the answer
back as it comes, counts its usage, and notes when each model was last asked for.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import TYPE_CHECKING, cast

from django.db import connection

from capyctl.gateway import replicas
from capyctl.gateway.advice import with_capyctl_hint
from capyctl.gateway.context import RequestContext
from capyctl.gateway.errors import GatewayError
from capyctl.gateway.routing import AGENT_PINS
from capyctl.gateway.upstream import UpstreamError, UpstreamPool
from capyctl.gateway.usage import UsageStrip, UsageTap
from capyctl.hosts.pki import pki
from capyctl.scheduler import gateway_api as scheduler
from hostagent import routes
from hostagent.asgi import HOP_BY_HOP, cancel_on_disconnect
from hostagent.tls import client_context

if TYPE_CHECKING:
    from capyctl.gateway.admission import StoredResponses

logger = logging.getLogger("capyctl.gateway")

# The client's key never reaches an engine: the instance's launch key replaces it. The
# engine's own date and server lines give way to the ones this server writes.
_HOP_BY_HOP = HOP_BY_HOP | {b"authorization", b"x-api-key", b"date", b"server"}
_NOT_FORWARDED = routes.NOT_FORWARDED | {b"authorization", b"x-api-key"}
_WHOLE_BODY_BYTES = 1024 * 1024  # sized answers up to this are passed on in one piece


class Forwarding:
    """The connections to engines and relays, and what the answers they give count."""

    def __init__(self, stored_responses: StoredResponses) -> None:
        self._upstream: UpstreamPool | None = None
        self._tls: ssl.SSLContext | None = None
        self._touched: dict[int, float] = {}
        self.stored_responses = stored_responses

    def client(self) -> UpstreamPool:
        if self._upstream is None or self._upstream.closed:
            self._upstream = UpstreamPool()
        return self._upstream

    def _agent_tls(self) -> ssl.SSLContext:
        if self._tls is None:
            where = pki()
            self._tls = client_context(
                where.ca_cert, where.server_cert, where.server_key, pins=AGENT_PINS
            )
        return self._tls

    async def close(self) -> None:
        """Close the connections to engines."""
        if self._upstream is not None:
            await self._upstream.close()

    async def forward(self, ctx: RequestContext) -> None:
        """Send the admitted request to its engine and its answer to the client; a client
        that goes away stops it."""
        route, scope = ctx.route, ctx.scope
        upstream_headers = routes.forwarded_headers(ctx.headers, _NOT_FORWARDED)
        upstream_headers.append((b"authorization", f"Bearer {route.launch_key}".encode()))
        # The route's own path, never the client's text: nothing for a parser to re-read.
        url = f"{route.base_url}{ctx.target.path}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        self.touch(route.deployment_id)
        want_id = scope["method"] == "POST" and ctx.target.path == routes.RESPONSES
        tap = UsageTap(want_response_id=want_id)
        # The answer streams in this task; a watcher cancels it if the client goes away, so
        # the engine stops generating for no one (one extra task a request, no more).
        this = cast("asyncio.Task[None]", asyncio.current_task())
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(cancel_on_disconnect(ctx.receive, this, gone))
        try:
            await self.stream(ctx, url, upstream_headers, tap)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # cancelled for another reason (shutdown): not ours to swallow
            this.uncancel()
        finally:
            watcher.cancel()
            key, outcome = ctx.key, ctx.outcome
            if tap.response_id is not None:
                self.stored_responses.put(tap.response_id, route.name, key.user_id)
            outcome.prompt_tokens, outcome.completion_tokens = tap.tokens()
            outcome.forwarded = True  # its usage is counted as the request ends

    async def stream(
        self, ctx: RequestContext, url: str, headers: list[tuple[bytes, bytes]], tap: UsageTap
    ) -> None:
        """Ask ``url`` (with ``headers``, ``ctx.body``) and pass its answer to ``ctx.send``
        as it comes; 502 ``engine_failed`` when the engine does not answer, or the
        stream's error line when it breaks off after the head went out."""
        outcome, send = ctx.outcome, ctx.send
        method, tls_name, waited_ms = ctx.scope["method"], ctx.route.tls_name, outcome.queued_ms
        sent_headers = False
        try:
            # A remote host's relay: mutual TLS, its certificate checked for its name.
            tls = self._agent_tls() if tls_name is not None else None
            upstream = await self.client().request(
                method, url, headers, ctx.body, ssl_context=tls, server_hostname=tls_name
            )
            # Closed before its end (an error, a client gone), its connection is closed,
            # so the engine stops generating; ended cleanly, it is kept for the next.
            async with upstream:
                out = [(k, v) for k, v in upstream.raw_headers if k.lower() not in _HOP_BY_HOP]
                outcome.status = upstream.status
                outcome.headers_at = time.perf_counter()
                overhead = (outcome.headers_at - ctx.started) * 1000 - waited_ms
                outcome.overhead = overhead / 1000
                out.append((b"x-capyctl-overhead-ms", f"{overhead:.1f}".encode()))
                out.append((b"x-capyctl-queued-ms", f"{waited_ms:.0f}".encode()))
                if outcome.switch:
                    out.append((b"x-capyctl-switch", outcome.switch.encode()))
                if ctx.group is not None:  # a model of several replicas: which one served
                    out.append((b"x-capyctl-replica", replicas.label(ctx.route)))
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
                strip = UsageStrip() if outcome.strip_usage else None
                async for chunk in upstream.iter_chunks():
                    tap.feed(chunk)
                    if strip is not None and not (chunk := strip.feed(chunk)):
                        continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rest = strip.rest() if strip is not None else b""
                await send({"type": "http.response.body", "body": rest, "more_body": False})
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

    def touch(self, deployment_id: int) -> None:
        """Note that the model was asked for (its idleness counts from now), at most once a
        second for each, off the event loop."""
        now = time.monotonic()
        if now - self._touched.get(deployment_id, 0.0) >= 1.0:
            self._touched[deployment_id] = now
            asyncio.get_running_loop().run_in_executor(None, _touch_sync, deployment_id)


def _touch_sync(deployment_id: int) -> None:
    try:
        scheduler.note_asked_for(deployment_id)
    except Exception as exc:  # idleness only: the next request touches it again
        logger.debug("could not note a request's end on %s: %s", deployment_id, exc)
    finally:
        connection.close()
