"""What each ``/v1`` request came to, in the server's log, and the methods each route takes.

One line a request, on the ``capyctl.access`` logger at INFO, once its answer is done::

    POST /v1/chat/completions model=chat status=200 412.3ms key=m8x6ps774i

The key is named by its id, never by its secret; a request refused before its key was
known says ``key=-``, and one refused before its model was resolved ``model=-``. The path
is the route's own (a path that is no route is quoted as it came, cut short), so a
client's text never shapes the log's lines. ``CAPYCTL_LOG_LEVEL=WARNING`` turns them off.
"""

from __future__ import annotations

import logging
import time

from capyctl.gateway.errors import GatewayError
from hostagent import routes

logger = logging.getLogger("capyctl.access")

_SHOWN = 120  # characters of a path that is no route
_POST = ("POST",)
_GET = ("GET",)


def allowed_methods(target: routes.Target) -> tuple[str, ...]:
    """The methods ``target`` answers."""
    if target.kind == "forward":
        return _POST
    if target.kind == "models":
        return _GET
    # A stored response: read or delete it; cancel it; list its input items.
    action = target.path.rsplit("/", 1)[-1]
    if action == "cancel":
        return _POST
    if action == "input_items":
        return _GET
    return ("GET", "DELETE")


def method_not_allowed(method: str, target: routes.Target) -> GatewayError:
    """405 with ``Allow``, OpenAI-shaped, for a method ``target`` does not take."""
    allowed = ", ".join(allowed_methods(target))
    return GatewayError(
        405,
        "method_not_allowed",
        f"`{target.path}` answers {allowed} only, not {method[:16]}.",
        retry=False,
        headers=[(b"allow", allowed.encode())],
    )


def log_request(method: str, path: str, started: float, *, model: str, status: int,
                key_id: str) -> None:  # fmt: skip
    """The access line of one request; ``path`` is its route's (or :func:`quoted`)."""
    if logger.isEnabledFor(logging.INFO):
        took_ms = (time.perf_counter() - started) * 1000
        logger.info("%s %s model=%s status=%d %.1fms key=%s", method, path, model, status,
                    took_ms, key_id)  # fmt: skip


def quoted(path: str) -> str:
    """A path that is no route, as the log shows it: quoted, cut short."""
    return repr(path[:_SHOWN])
