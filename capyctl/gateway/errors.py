"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, and
:func:`respond`, which sends such an answer (or any small one) in one piece."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# What an internal address looks like in a message (a URL, an IP address or localhost,
# with a port or not, or a port named on its own as database drivers do): the log keeps
# it, a client is not told it.
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S+|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"
    r"|\[[0-9a-f:.]+\](?::\d+)?|\blocalhost(?::\d+)?\b|\bport \d+\b",
    re.IGNORECASE,
)


@dataclass
class GatewayError(Exception):
    status: int
    code: str
    message: str
    type: str = "invalid_request_error"
    retry: bool = True
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    param: str | None = None  # the request field at fault, where one is

    def body(self) -> bytes:
        # A server-side failure (an engine's, a host's) may quote where it happened.
        message = self.message if self.status < 500 else _ADDRESS.sub("[internal]", self.message)
        return json.dumps(
            {
                "error": {
                    "message": message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        ).encode()

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json"), *self.headers]
        if not self.retry:
            headers.append((b"x-should-retry", b"false"))
        return headers


def invalid_key() -> GatewayError:
    return GatewayError(
        401, "invalid_api_key", "Incorrect or missing API key.", "authentication_error", False
    )


def model_not_found(name: str) -> GatewayError:
    return GatewayError(
        404,
        "model_not_found",
        f"The model `{name}` does not exist or you do not have access to it.",
        "invalid_request_error",
        False,
    )


def control_plane_down(message: str, retry_after: int = 1) -> GatewayError:
    return GatewayError(
        503,
        "control_plane_unavailable",
        message,
        "server_error",
        headers=[(b"retry-after", str(retry_after).encode())],
    )


async def respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
