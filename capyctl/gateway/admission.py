"""Admission: what a ``/v1`` request must pass before it reaches an engine. :class:`Admission`
checks the route, the key and its limits, reads the body, looks the model up and checks
what it asks (answering ``GET /v1/models`` itself), then admits the request on a ready
engine, through the model's queue when it must wait. Also the body readers
(:func:`_model_of`, :func:`_rename_model`) and :class:`StoredResponses`.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from capyctl.deployments import guards
from capyctl.errors import UserError
from capyctl.gateway import access, adapters
from capyctl.gateway.budgets import Budgets
from capyctl.gateway.context import Outcome, RequestContext, Scope
from capyctl.gateway.cost import EngineShares
from capyctl.gateway.errors import GatewayError, invalid_key, model_not_found, respond
from capyctl.gateway.keys import KeyCache, KeyInfo
from capyctl.gateway.replicas import Replicas
from capyctl.gateway.routing import Route, RoutingTable, list_models
from capyctl.gateway.usage import Limits
from capyctl.gateway.waiting import Waiting
from capyctl.scheduler import gateway_api as scheduler
from capyctl.validation import validate_alias
from hostagent import routes

# Engines that send a stream's usage when asked (``stream_options.include_usage``), on the
# routes that take it; a custom server is not asked for what it may not know.
_ASKS_FOR_USAGE = frozenset({"vllm", "sglang", "llamacpp", "tensorfold"})
_USAGE_PATHS = frozenset({routes.CHAT_COMPLETIONS, routes.COMPLETIONS})
_GATE_TRIES = 3  # waits for a wake when a drain closed the gate under a request
# The form's `model` part: its headers (non-empty lines) end at the first blank line.
_MULTIPART_MODEL = re.compile(rb'name="model"\r\n(?:[^\r\n]+\r\n)*?\r\n([^\r\n]*)\r\n')


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


class Admission:
    """Key check, limits, model lookup and queue admission."""

    def __init__(
        self,
        keys: KeyCache,
        limits: Limits,
        routes: RoutingTable,
        waiting: Waiting,
        stored_responses: StoredResponses,
        *,
        budgets: Budgets,
    ) -> None:
        self.keys = keys
        self.limits = limits
        self.budgets = budgets
        self.shares = EngineShares()
        self.routes = routes
        self.waiting = waiting
        self.stored_responses = stored_responses
        self.replicas = Replicas()

    async def check(
        self, scope: Scope, receive: Any, send: Any, started: float, outcome: Outcome
    ) -> RequestContext | None:
        """The request's context, once its route, key, limits, body and model passed; None
        when it was answered here (``GET /v1/models``). Each refusal is a
        :class:`GatewayError`; the key admitted is noted in ``outcome``, to be let go of
        when the request ends."""
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
        # Per minute and in flight, the key's and its user's; released when the request ends.
        outcome.admitted = (key, await self.limits.admit(key))
        if target.kind == "models":
            await self._models(send, key, target.name)
            outcome.status = 200
            return None
        body = await _read_body(receive, int(settings.CAPYCTL["MAX_BODY_BYTES"]))
        name, parsed = self._model_named(target, key, headers, body)
        outcome.stream = parsed is not None and parsed.get("stream") is True
        route = await self.routes.get(name)
        if route is None or not key.allows(route.ref):
            raise model_not_found(name)
        outcome.model = route.asked_for  # a label only once it names a model the key may use
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
        if outcome.stream and parsed is not None and route.kind in _ASKS_FOR_USAGE:
            body, parsed = _with_usage(body, parsed, target.path, outcome)
        outcome.prices = route.prices
        # Every budget that applies must have room: its worst case is reserved in each.
        outcome.reservation = await self.budgets.admit(
            key, route, parsed, len(body), self.shares.typical(route.deployment_id)
        )
        adapter = route.adapter
        if adapter is not None:  # served by its base, under the name its engine knows
            body = adapters.request_body(body, parsed, route, adapter)
        elif name != route.name:  # an alias: the engine serves the deployment's own name
            body = _rename_model(body, parsed, route.name)
        if route.replicas:  # several replicas: one of them, or the one to wait for
            affinity = scheduler.affinity_key(headers, parsed) if route.affinity else None
            group, route = route, self.replicas.choose(route, affinity)
            return RequestContext(scope, receive, send, key, headers, body, route, target,
                                  started, outcome, group=group, affinity=affinity,
                                  adapter=adapter)  # fmt: skip
        return RequestContext(scope, receive, send, key, headers, body, route, target, started,
                              outcome, adapter=adapter)  # fmt: skip

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

    async def admit(self, ctx: RequestContext) -> None:
        """Count the request in flight on a ready engine, waiting for a wake if needed;
        ``ctx.route`` becomes the route to use, and ``ctx.outcome`` notes the milliseconds
        waited and what the wake switched. A client that goes away while it waits leaves
        the queue at once (:class:`~capyctl.gateway.waiting.ClientGone`)."""
        route, outcome = ctx.route, ctx.outcome
        ready = route.observed_state == "ready" and route.base_url is not None
        for _ in range(_GATE_TRIES):
            if not ready:
                wait_started = time.perf_counter()
                try:
                    route, switch, share = await self.waiting.wait_or_leave(
                        route, ctx.receive, ctx.key.pk
                    )
                    outcome.switch = switch or outcome.switch
                    outcome.switch_gpu_seconds += share
                except GatewayError as refused:  # it says how long it waited, too
                    waited_ms = outcome.queued_ms + (time.perf_counter() - wait_started) * 1000
                    refused.headers.append((b"x-capyctl-queued-ms", f"{waited_ms:.0f}".encode()))
                    raise
                finally:  # served, refused or left: its trace says how long it waited
                    outcome.queued_ms += (time.perf_counter() - wait_started) * 1000
            if await scheduler.begin_request(route.deployment_id):
                ctx.route = route
                outcome.held = self.shares.begin(route.deployment_id, len(route.gpus))
                if ctx.group is not None:
                    self.replicas.began(ctx.group, route, ctx.started, ctx.outcome)
                return
            ready = False  # it began draining after our route was read: wait for the wake
        raise GatewayError(
            503,
            "unavailable",
            f"`{route.name}` is being switched over and over; retry shortly.",
            "server_error",
            headers=[(b"retry-after", b"1")],
        )

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
                **(
                    {"parent": m["parent"]}
                    if "parent" in m
                    else {
                        # requests this process holds waiting for it to be started or woken
                        "waiting": self.waiting.queues.count(int(str(m["ref"])))
                    }
                ),
            }
            for m in models
            if key.allows(int(str(m["ref"])))
        ]
        if one is not None:
            found = [m for m in data if m["id"] == one]
            if not found:
                raise model_not_found(one)
            body = json.dumps(found[0]).encode()
        else:
            body = json.dumps({"object": "list", "data": data}).encode()
        await respond(send, 200, body, [(b"content-type", b"application/json")])


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


def _with_usage(
    body: bytes, parsed: dict[str, Any], path: str, outcome: Outcome
) -> tuple[bytes, dict[str, Any]]:
    """A stream's body asking its engine for the usage chunk (so its tokens are counted);
    ``outcome.strip_usage`` says the client did not ask for it and will not get it."""
    if path not in _USAGE_PATHS:
        return body, parsed
    options = parsed.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, parsed
    outcome.strip_usage = True
    given = options if isinstance(options, dict) else {}
    parsed = {**parsed, "stream_options": {**given, "include_usage": True}}
    return json.dumps(parsed).encode(), parsed


def _rename_model(body: bytes, parsed: dict[str, Any] | None, served_name: str) -> bytes:
    if parsed is not None:
        return json.dumps({**parsed, "model": served_name}).encode()
    match = _MULTIPART_MODEL.search(body)
    if match is None:
        return body
    return body[: match.start(1)] + served_name.encode() + body[match.end(1) :]
