"""The ASGI application: a Channels protocol router.

HTTP goes to Django (admin, probes, pages) except ``/v1``, ``/metrics`` and static assets,
which small ASGI apps serve directly. WebSockets (the dashboard's live feed) go through
Channels' origin check and session authentication.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.core.asgi import get_asgi_application
from django.urls import path

django_application = get_asgi_application()

from capyctl.gateway.app import gateway  # noqa: E402
from capyctl.web.consumers import DashboardConsumer  # noqa: E402
from capyctl.web.metrics import metrics_application  # noqa: E402
from capyctl.web.staticfiles import StaticFilesApp  # noqa: E402

static_application = StaticFilesApp()


async def http_application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Route one HTTP request to the app that serves its path."""
    path = str(scope["path"])
    if path.startswith("/v1/"):
        await gateway(scope, receive, send)
    elif path == "/metrics":
        await metrics_application(scope, receive, send)
    elif static_application.handles(scope):
        await static_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)


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


websocket_application = AllowedHostsOriginValidator(
    AuthMiddlewareStack(URLRouter([path("ws/dashboard/", DashboardConsumer.as_asgi())]))
)

application = ProtocolTypeRouter(
    {
        "http": http_application,
        "websocket": websocket_application,
        "lifespan": lifespan_application,
    }
)
