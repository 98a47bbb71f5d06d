"""The OpenAI routes that ``/v1`` serves: ONE allowlist, for the server's gateway and the
host agent's relay alike.

An engine serves more than ``/v1``: vLLM's ``/sleep`` and ``/collective_rpc``, SGLang's
``/release_memory_occupation`` and ``/update_weights_from_disk``, llama.cpp's ``/props``
control it. So a path is taken apart before anything else: a ``.``, ``..`` or empty
segment, an encoded ``/``, ``\\``, ``.`` or ``%`` (any case, so double encoding too), a
``\\``, or bytes that are not UTF-8 make it malformed (400); a well-formed path that is
not a route here is unknown (404). What goes to an engine is the route's own canonical
path, never the client's text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from hostagent.asgi import HOP_BY_HOP

PREFIX = "/v1/"
MODELS = "/v1/models"  # answered by the server itself: the list, or one model by name
RESPONSES = "/v1/responses"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Forwarded to the model's engine; the model is named in the body (JSON or a form).
FORWARDED = frozenset(
    {
        CHAT_COMPLETIONS,
        COMPLETIONS,
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        RESPONSES,
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/audio/speech",
    }
)
# A stored response (``/v1/responses/{id}`` and these sub-paths), which names no model.
STORED_ACTIONS = frozenset({"cancel", "input_items"})
_RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,200}\Z")
# Escapes that decode to a separator, a dot or another escape; a literal backslash.
_MALFORMED = re.compile(rb"%(?:2[eEfF]|5[cC]|25)|\\")
_MEANING = {"%2e": "an encoded dot", "%2f": "an encoded slash", "%5c": "an encoded backslash",
            "%25": "an encoded percent sign", "\\": "a backslash"}  # fmt: skip
_SHOWN = 120  # characters of a refused path an error repeats
# Request headers never passed on: the connection's own, the client's cookies, and what
# proxies on the way said about the client (``X-Forwarded-*`` too: see forwarded_headers).
NOT_FORWARDED = HOP_BY_HOP | {b"cookie", b"forwarded"}


class RouteError(Exception):
    """A path refused: ``status`` 400 (malformed) or 404 (not a route), OpenAI-shaped."""

    def __init__(
        self, status: int, code: str, message: str, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.kind = kind

    def as_json(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": None,
                "code": self.code,
            }
        }


@dataclass(frozen=True, slots=True)
class Target:
    """What a path asks for: ``kind`` is ``forward`` (``path`` to the engine), ``models``
    (``name``: one model, or None for the list) or ``stored`` (``name``: a response id;
    ``path`` to the engine that made it)."""

    kind: str
    path: str
    name: str | None = None


_FAST = {route.encode(): Target("forward", route) for route in FORWARDED}
_FAST[MODELS.encode()] = Target("models", MODELS)


def resolve(raw_path: bytes, path: str | None = None) -> Target:
    """The route ``raw_path`` (the bytes as received, no query) names; ``path`` is the
    server's own decoding of it, which must agree. Raises :class:`RouteError`."""
    fast = _FAST.get(raw_path)
    if fast is not None and (path is None or path == fast.path):
        return fast  # the common case: one dict lookup
    shown = raw_path.decode("latin-1")[:_SHOWN]
    found = _MALFORMED.search(raw_path)
    if found is not None:
        escape = found.group().decode().lower()
        raise _malformed(shown, _MEANING[escape] + (f" ({escape})" if escape != "\\" else ""))
    try:
        decoded = unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed(shown, "bytes that are not UTF-8") from None
    if path is not None and path != decoded:
        raise _malformed(shown, "a form the server decoded differently")
    if not decoded.startswith(PREFIX):
        raise _unknown(shown)
    segments = decoded[1:].split("/")
    if len(segments) > 2 and segments[-1] == "":
        segments.pop()  # one trailing slash is only a trailing slash
    for segment in segments:
        if segment in ("", ".", ".."):
            raise _malformed(shown, f"a `{segment}` segment" if segment else "an empty segment")
    canonical = "/" + "/".join(segments)
    if canonical in FORWARDED:
        return Target("forward", canonical)
    if canonical == MODELS:
        return Target("models", MODELS)
    if segments[1] == "models":  # a name may hold `/` (aliases such as org/model)
        return Target("models", MODELS, "/".join(segments[2:]))
    if (
        segments[1] == "responses"
        and len(segments) in (3, 4)
        and _RESPONSE_ID.match(segments[2])
        and (len(segments) == 3 or segments[3] in STORED_ACTIONS)
    ):
        return Target("stored", canonical, segments[2])
    raise _unknown(shown)


def _malformed(shown: str, what: str) -> RouteError:
    return RouteError(400, "invalid_path", f"The path `{shown}` has {what}: refused.")


def _unknown(shown: str) -> RouteError:
    return RouteError(
        404, "unknown_route", f"`{shown}` is not an OpenAI route this endpoint serves."
    )


def forwarded_headers(
    headers: Mapping[bytes, bytes], drop: frozenset[bytes] = NOT_FORWARDED
) -> list[tuple[bytes, bytes]]:
    """The request headers (lowercase names) that go on to an engine: not those in
    ``drop``, no ``X-Forwarded-*``, none that the ``Connection`` header names."""
    named = headers.get(b"connection")
    if named:
        drop = drop | {name.strip() for name in named.lower().split(b",")}
    return [(k, v) for k, v in headers.items() if k not in drop and k[:12] != b"x-forwarded-"]
