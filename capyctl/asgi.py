"""The ASGI application: a Channels protocol router.

HTTP goes to Django (admin, probes, pages) except ``/v1``, ``/metrics`` and static assets,
which small ASGI apps serve directly. No body larger than its route takes is read: a
``Content-Length`` over the limit is answered 413 at once, and a body without one is
counted as it arrives (``/v1``: the gateway's own limit; everything else:
``HTTP_MAX_WEB_BODY_BYTES``, which Django keeps in memory, never in a temporary file).
WebSockets (the dashboard's live feed) take pages of their own origin only (scheme, host
and port, as Django's CSRF check compares them) and authenticate by session.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest
from django.urls import path
from django.utils.http import is_same_domain

django_application = get_asgi_application()

from capyctl.gateway.app import gateway  # noqa: E402
from capyctl.gateway.errors import GatewayError  # noqa: E402
from capyctl.web.consumers import DashboardConsumer  # noqa: E402
from capyctl.web.metrics import metrics_application  # noqa: E402
from capyctl.web.staticfiles import StaticFilesApp  # noqa: E402

static_application = StaticFilesApp()


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # the server refused others
    return None


async def _too_large(send: Any, path: str, limit: int) -> None:
    """413 in the route's own shape: OpenAI's on /v1, REST's on /api/, else plain."""
    text = f"The request body is larger than {limit} bytes."
    if path.startswith("/v1/"):
        body, kind = GatewayError(413, "request_too_large", text).body(), b"application/json"
    elif path.startswith("/api/"):
        body, kind = json.dumps({"detail": text}).encode(), b"application/json"
    else:
        body, kind = text.encode() + b"\n", b"text/plain; charset=utf-8"
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _BodyLimit:
    """``receive`` and ``send`` of one request whose body may not pass ``limit`` bytes:
    past it, 413 (unless an answer has begun) and the application hears a disconnect."""

    def __init__(self, receive: Any, send: Any, path: str, limit: int) -> None:
        self._receive, self._send, self.path, self.limit = receive, send, path, limit
        self.size = 0
        self.started = self.refused = False

    async def receive(self) -> dict[str, Any]:
        if self.refused:
            return {"type": "http.disconnect"}
        message: dict[str, Any] = await self._receive()
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limit:
                self.refused = True
                if not self.started:
                    self.started = True
                    await _too_large(self._send, self.path, self.limit)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Mapping[str, Any]) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


async def http_application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Route one HTTP request to the app that serves its path."""
    path = str(scope["path"])
    if path.startswith("/v1/"):  # the gateway counts the body itself
        limit = int(settings.CAPYCTL["MAX_BODY_BYTES"])
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await _too_large(send, path, limit)
        else:
            await gateway(scope, receive, send)
        return
    limit = int(settings.CAPYCTL["HTTP_MAX_WEB_BODY_BYTES"])
    declared = _declared_length(scope)
    if declared is not None and declared > limit:
        await _too_large(send, path, limit)
        return
    bounded = _BodyLimit(receive, send, path, limit)
    if path == "/metrics":
        await metrics_application(scope, bounded.receive, bounded.send)
    elif static_application.handles(scope):
        await static_application(scope, bounded.receive, bounded.send)
    else:
        await django_application(scope, bounded.receive, bounded.send)


async def lifespan_application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Start-up and shutdown: the gateway closes its engine connections on the way out."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await gateway.close()
            await send({"type": "lifespan.shutdown.complete"})
            return


class _Handshake(HttpRequest):
    """A WebSocket handshake as Django's CSRF check reads a request."""

    def __init__(self, scope: dict[str, Any]) -> None:
        super().__init__()
        server = scope.get("server") or ("", "")
        self.META = {"SERVER_NAME": str(server[0]), "SERVER_PORT": str(server[1] or "")}
        for name, value in scope.get("headers") or []:
            key = "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
            self.META[key] = value.decode("latin-1")
        self._handshake_scheme = "https" if scope.get("scheme") == "wss" else "http"

    def _get_scheme(self) -> str:
        return self._handshake_scheme


def _origin_verified(request: HttpRequest, origin: str) -> bool:
    """The origin check of Django's CSRF middleware (``_origin_verified``): the request's
    own scheme and host (one it answers to) with its port, or a trusted origin."""
    try:
        host = request.get_host()
    except DisallowedHost:
        pass
    else:
        if origin == f"{'https' if request.is_secure() else 'http'}://{host}":
            return True
    trusted = settings.CSRF_TRUSTED_ORIGINS
    if origin in [exact for exact in trusted if "*" not in exact]:
        return True
    try:
        asked = urlsplit(origin)
    except ValueError:
        return False
    return any(
        is_same_domain(asked.netloc, allowed.netloc.lstrip("*"))
        for allowed in (urlsplit(pattern) for pattern in trusted if "*" in pattern)
        if allowed.scheme == asked.scheme
    )


class SameOriginValidator:
    """Let a WebSocket through only from a page of the server's own origin (the scheme,
    host and port it was reached at, the host one it answers to) or of
    ``CSRF_TRUSTED_ORIGINS``: the comparison Django's CSRF check makes for a form."""

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = _Handshake(scope)
        origin = request.META.get("HTTP_ORIGIN")
        if origin is not None and _origin_verified(request, origin):
            await self.application(scope, receive, send)
        else:
            await WebsocketDenier()(scope, receive, send)


websocket_application = SameOriginValidator(
    AuthMiddlewareStack(URLRouter([path("ws/dashboard/", DashboardConsumer.as_asgi())]))
)

application = ProtocolTypeRouter(
    {
        "http": http_application,
        "websocket": websocket_application,
        "lifespan": lifespan_application,
    }
)
