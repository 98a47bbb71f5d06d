"""Small pieces shared by the agent's and the enrolment listener's raw ASGI apps."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

# Headers that belong to one connection, not to the request or answer passed on.
HOP_BY_HOP = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
    }
)


# How long a stop waits for open connections. A TLS connection closes only when its peer
# answers the close, and a client that holds an idle keep-alive connection without reading
# (a server whose worker is stuck) never does: uvicorn would wait 30 s for it, long past
# the few seconds a Ctrl-C followed by a kill allows, and the agent's engines would outlive it.
STOP_GRACE_SECONDS = 5


async def lifespan(receive: Any, send: Any) -> None:
    """Answer an ASGI lifespan scope: nothing to start or stop."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def send_bytes(send: Any, status: int, body: bytes, kind: bytes) -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Any, status: int, data: Any) -> None:
    await send_bytes(send, status, json.dumps(data).encode(), b"application/json")


def tls_server(app: Any, host: str, port: int, context: ssl.SSLContext) -> Any:
    """A uvicorn server for ``app`` on ``host:port`` with OUR TLS context (uvicorn's own
    options cannot ask for TLS 1.2 as the minimum)."""
    import uvicorn  # noqa: PLC0415 - only where a TLS server starts; the gateway imports this module

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        log_config=None,  # leave the process's logging as it is
        timeout_graceful_shutdown=STOP_GRACE_SECONDS,
    )
    config.load()
    config.ssl = context
    return uvicorn.Server(config)


async def cancel_on_disconnect(receive: Any, task: asyncio.Task[Any], gone: asyncio.Event) -> None:
    """Cancel ``task`` when the client goes away (and say so in ``gone``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not task.done():
        gone.set()
        task.cancel()
