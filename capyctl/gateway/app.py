"""The ``/v1`` ASGI app: authenticate, resolve, wait for a ready engine, forward.

Order of events (DESIGN §4): route (one allowlist, ``hostagent.routes``) → key → body
(bounded) → model → allowed? → desired state → ready, or wait in the model's bounded
queue while ONE wake runs → forward with the launch key, streaming the answer back
unbuffered. Every error is OpenAI-shaped.

Here: :class:`Gateway`, the entry point that counts, logs and traces each request, and the
one ``gateway`` the server runs. Its steps are in :mod:`~capyctl.gateway.admission`,
:mod:`~capyctl.gateway.waiting` and :mod:`~capyctl.gateway.forwarding`; what a request
carries through them in :mod:`~capyctl.gateway.context`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.conf import settings

from capyctl.gateway import access, adapters
from capyctl.gateway.admission import Admission, StoredResponses
from capyctl.gateway.batches import BatchedWrites
from capyctl.gateway.budgets import Budgets, spend_of
from capyctl.gateway.context import Outcome, RequestContext, Scope
from capyctl.gateway.errors import GatewayError, control_plane_down, respond
from capyctl.gateway.forwarding import Forwarding
from capyctl.gateway.keys import KeyCache
from capyctl.gateway.routing import RoutingTable
from capyctl.gateway.usage import UsageBook, make_limiter, write_usage
from capyctl.gateway.waiting import ClientGone, KeepAlive, Waiting
from capyctl.scheduler import gateway_api as scheduler
from capyctl.scheduler.gateway_api import is_control_plane_error, outage
from capyctl.traces.recording import TraceBook, TraceWriter
from capyctl.web import metrics

logger = logging.getLogger("capyctl.gateway")


class Gateway:
    """The ``/v1`` app: each request passes :class:`~capyctl.gateway.admission.Admission`,
    waits in :class:`~capyctl.gateway.waiting.Waiting` when its model is not ready, and goes
    through :class:`~capyctl.gateway.forwarding.Forwarding`; what it came to is counted,
    logged and traced here."""

    def __init__(self) -> None:
        scheduler.serving()
        self.keys = KeyCache()
        self.routes = RoutingTable()
        self.limits = make_limiter(settings.REDIS_URL)
        self.budgets = Budgets(settings.REDIS_URL)
        self.usage = UsageBook()
        self._usage_writes = BatchedWrites(self.usage, write_usage, "usage")
        self.traces = TraceBook()
        self._trace_writes = BatchedWrites(self.traces, TraceWriter(), "traces")
        # Read once: a settings lookup costs more than the rest of a request's trace.
        self._tracing = bool(settings.CAPYCTL["TRACE"])
        self.stored_responses = StoredResponses()
        self.waiting = Waiting(self.routes)
        self.admission = Admission(
            self.keys,
            self.limits,
            self.routes,
            self.waiting,
            self.stored_responses,
            budgets=self.budgets,
        )
        self.forwarding = Forwarding(self.stored_responses)

    # -- the ASGI entry point ----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        started = time.perf_counter()
        outcome = Outcome()
        try:
            await self._handle(scope, receive, send, started, outcome)
        except GatewayError as error:
            outcome.status, outcome.code = error.status, error.code
            await respond(send, error.status, error.body(), error.response_headers())
        except Exception as exc:  # never a bare 500: an OpenAI-shaped answer, logged once
            # The path as a quoted literal: a client's text never shapes the log's lines.
            logger.exception("%s %r failed in the gateway", scope.get("method"), scope.get("path"))
            if outcome.headers_at:
                return  # the answer had begun: it ends here, and its client sees it cut
            failure = _failure(exc)
            outcome.status, outcome.code = failure.status, failure.code
            await respond(send, failure.status, failure.body(), failure.response_headers())
        finally:
            if outcome.admitted is not None:
                await self.limits.leave(*outcome.admitted)
                try:
                    await self._count(outcome, started)
                except Exception:  # its answer is out: what it used is logged as lost
                    logger.exception("could not count what a request to %s used", outcome.model)
            metrics.count(outcome.model, outcome.status, started, outcome.headers_at,
                          outcome.overhead)  # fmt: skip
            key_id = outcome.admitted[0].key_id if outcome.admitted is not None else "-"
            access.log_request(scope["method"], outcome.path or access.quoted(scope["path"]),
                               started, model=outcome.model, status=outcome.status,
                               key_id=key_id)  # fmt: skip
            if self._tracing and outcome.admitted is not None and outcome.model != "-":
                self._trace(outcome, outcome.admitted[0].pk, started)

    async def _count(self, outcome: Outcome, started: float) -> None:
        """What the request used, in its key's usage (dated when it began, as its
        reservation's period is) and its budgets (its reservation settled)."""
        key = outcome.admitted[0]  # type: ignore[index]  # counted only once admitted
        prompt, completion = outcome.prompt_tokens, outcome.completion_tokens
        gpu = outcome.gpu_seconds + outcome.switch_gpu_seconds
        spend = spend_of(outcome.prices, prompt, completion, gpu)
        if outcome.forwarded:  # the record first: a settle that fails loses none of it
            began = time.time() - (time.perf_counter() - started)
            self.usage.add(key.pk, prompt, completion, model=outcome.model, team_id=key.team_id,
                           at=began, gpu_seconds=outcome.gpu_seconds,
                           switch_gpu_seconds=outcome.switch_gpu_seconds, spend=spend)  # fmt: skip
            self._usage_writes.soon()
        if outcome.reservation is not None:
            reservation, outcome.reservation = outcome.reservation, None
            await self.budgets.settle(reservation, (prompt + completion, gpu, spend))

    def _trace(self, outcome: Outcome, key_pk: int, started: float) -> None:
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
        self, scope: Scope, receive: Any, send: Any, started: float, outcome: Outcome
    ) -> None:
        ctx = await self.admission.check(scope, receive, send, started, outcome)
        if ctx is None:  # answered already (GET /v1/models)
            return
        route = ctx.route
        waits = route.observed_state != "ready" or route.base_url is None
        if waits and ctx.stream:
            # A stream that waits gets its head and comment lines meanwhile (see KeepAlive).
            keepalive = KeepAlive(send, route, self.routes, outcome)
            ctx.send, ctx.keepalive = keepalive.send, keepalive
            try:
                await self._admit_and_forward(ctx)
            except Exception as exc:
                if not await keepalive.stop():
                    raise  # nothing was sent yet: an ordinary error answer
                await keepalive.fail(_answer(exc, f"{scope.get('method')} {str(scope['path'])!r}"))
            finally:
                await keepalive.stop()
            return
        await self._admit_and_forward(ctx)

    async def _admit_and_forward(self, ctx: RequestContext) -> None:
        """Admit, forward and count the request; while it waits and while it is in flight,
        its class (its key's) counts for the model it wants, for turns."""
        _wants(ctx, ctx.route.deployment_id)
        try:
            await self._admitted_and_forwarded(ctx)
        finally:
            _wants(ctx, None)

    async def _admitted_and_forwarded(self, ctx: RequestContext) -> None:
        try:
            await self.admission.admit(ctx)
        except ClientGone:  # it left the queue, and counts for nothing
            ctx.outcome.status = 499
            return
        deployment_id, adapter = ctx.route.deployment_id, ctx.adapter
        _wants(ctx, deployment_id)
        if adapter is not None:
            await adapters.begin(adapter)
        try:
            if adapter is not None:  # its base's engine holds it before it is asked
                await adapters.load(ctx, adapter)
            if ctx.keepalive is not None:
                await ctx.keepalive.stop()  # no more comment lines: the answer follows
            if waited_ms := ctx.outcome.queued_ms:
                metrics.WAITS.observe(ctx.route.name, waited_ms / 1000)
            try:
                await self.forwarding.forward(ctx)
            except GatewayError as failed:
                if not await self._failover(ctx, failed):
                    raise
                deployment_id = ctx.route.deployment_id  # counted there now
                _wants(ctx, deployment_id)
                if adapter is not None:
                    await adapters.load(ctx, adapter)
                await self.forwarding.forward(ctx)
        finally:
            if adapter is not None:
                await adapters.end(ctx, adapter)
            self._let_go(ctx)
            await scheduler.end_request(deployment_id)
            if ctx.group is not None:
                self.admission.replicas.ended(ctx.group, deployment_id, ctx.outcome)
            self.forwarding.touch(deployment_id)  # idleness counts from a request's end

    def _let_go(self, ctx: RequestContext) -> None:
        """The request no longer holds its engine: its share of the engine's GPU time."""
        held, ctx.outcome.held = ctx.outcome.held, None
        if held is not None:
            ctx.outcome.gpu_seconds += self.admission.shares.end(held)

    async def _failover(self, ctx: RequestContext, failed: GatewayError) -> bool:
        """A replica's engine failed the request before any byte of its answer went out:
        count it on another ready replica instead (once), and say whether to try there."""
        group, replica = ctx.group, ctx.route
        if group is None or failed.code != "engine_failed" or ctx.outcome.headers_at:
            return False
        other = self.admission.replicas.failed(group, replica, ctx.affinity)
        if other is None or not await scheduler.begin_request(other.deployment_id):
            return False
        logger.warning("%s: replica %s failed a request; tried again on %s",
                       group.name, replica.name, other.name)  # fmt: skip
        self._let_go(ctx)
        await scheduler.end_request(replica.deployment_id)
        self.admission.replicas.ended(group, replica.deployment_id, ctx.outcome)
        ctx.outcome.held = self.admission.shares.begin(other.deployment_id, len(other.gpus))
        self.admission.replicas.began(group, other, ctx.started, ctx.outcome)
        ctx.route = other
        return True

    def stopping(self) -> None:
        """The server is stopping: requests waiting for a wake are answered now (503, retry)
        rather than cut when it exits; a wake under way goes on without them."""
        self.waiting.stopping()

    async def close(self) -> None:
        """Write the usage and traces not written yet, and close the connections to
        engines and Redis (at shutdown)."""
        await self.forwarding.close()
        await self._usage_writes.close()
        await self.budgets.close()
        await self._trace_writes.close()
        await self.limits.close()
        await self.keys.close()
        await self.routes.close()


def _wants(ctx: RequestContext, deployment_id: int | None) -> None:
    """The request's class (its key's) counts for ``deployment_id`` now (None: for none),
    for the scheduler's turns (:mod:`capyctl.scheduler.request_classes`)."""
    if ctx.wants == deployment_id:
        return
    if ctx.wants is not None:
        scheduler.class_end(ctx.wants, ctx.key.batch)
    if deployment_id is not None:
        scheduler.class_begin(deployment_id, ctx.key.batch)
    ctx.wants = deployment_id


def _failure(exc: Exception) -> GatewayError:
    """The answer for an unexpected failure: 503 ``control_plane_unavailable`` when the
    database or Redis did not answer (a retry soon may succeed), else 500
    ``internal_error``."""
    if is_control_plane_error(exc):
        told = outage(exc)
        return control_plane_down(told.message, told.retry_after)
    return GatewayError(
        500, "internal_error", "CapyCTL failed to handle this request; it was logged.",
        "server_error",
    )  # fmt: skip


def _answer(exc: Exception, what: str) -> GatewayError:
    """The error line that ends a waiting stream whose head went out: ``exc`` itself when
    it is an answer, else :func:`_failure`'s (the unexpected one logged once)."""
    if isinstance(exc, GatewayError):
        return exc
    logger.error("%s failed in the gateway", what, exc_info=exc)
    return _failure(exc)


gateway = Gateway()
