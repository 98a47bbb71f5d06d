"""What a ``/v1`` request may ask of a deployment's engine.

Two guards, each declared once here and applied by the routing table and the gateway;
the ceilings are deployment settings (:mod:`capyctl.deployments.settings_spec` declares
them from these) and the media domains are set through the same entry points:

- **Ceilings** on the counts a body asks for (``max_tokens``, ``n``, ``best_of``): a value
  past the deployment's ceiling is refused with 400 naming the field and the ceiling; a
  field left out (or null) is the engine's own default.
- **A media policy**: engines fetch the URLs a body names for images, audio and video (a
  request from the GPU host to wherever the client says). A string under a key named
  ``url`` or ``…_url`` anywhere in a JSON body must be a ``data:`` URL, or an ``http(s)``
  URL whose host is one of the deployment's media domains (none by default).

Plain Python, no Django: the gateway runs these on every request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_CEILING = 2**31 - 1  # within the 32-bit columns that hold them
MAX_MEDIA_DOMAINS = 64
# A host name as vLLM and SGLang compare it: lowercase labels of letters, digits and '-'
# (an IPv4 address is such a name too). No wildcard: the engines match exact names.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_DOMAIN = re.compile(rf"^(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*\Z")
# A name that never resolves (RFC 2606): an engine launched with only this as its allowed
# media domain fetches no remote media at all (an empty list would allow every domain).
NO_MEDIA_DOMAIN = "media.invalid"
MEDIA_POLICY = "media_domains"  # what a refusal names


@dataclass(frozen=True)
class Ceiling:
    """One ceiling: the Deployment field that holds it and the body fields it bounds."""

    name: str
    fields: tuple[str, ...]
    default: int
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


MAX_TOKENS = Ceiling(
    "max_tokens_ceiling",
    ("max_tokens", "max_completion_tokens", "max_output_tokens"),
    65536,
    "most tokens one request may ask it to generate (max_tokens, max_completion_tokens, "
    "max_output_tokens)",
)
N = Ceiling("n_ceiling", ("n",), 16, "most answers one request may ask for (n)")
BEST_OF = Ceiling(
    "best_of_ceiling", ("best_of",), 16, "most candidates one completion may ask for (best_of)"
)
CEILINGS = (MAX_TOKENS, N, BEST_OF)


def body_ceilings(values: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """Each body field with its ceiling, from the deployment's ``{name: ceiling}``."""
    return tuple((field, values[c.name]) for c in CEILINGS for field in c.fields)


class RequestRefusedError(ValueError):
    """A body that asks for what the deployment does not allow: ``param`` names the field."""

    def __init__(self, message: str, param: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_ceilings(body: dict[str, Any], ceilings: tuple[tuple[str, int], ...]) -> None:
    """Raise :class:`RequestRefusedError` for a field of ``body`` that is not a whole number of
    at least 0, or is past its ceiling."""
    for field, most in ceilings:
        value = body.get(field)
        if value is None:
            continue
        if type(value) is not int or value < 0:
            raise RequestRefusedError(
                f"Invalid '{field}': expected a whole number of at least 0, got {value!r:.40}.",
                field,
            )
        if value > most:
            raise RequestRefusedError(
                f"Invalid '{field}': {value} is above this model's ceiling of {most}.", field
            )


# -- media ------------------------------------------------------------------------------------


def check_domains(domains: Iterable[object]) -> list[str]:
    """The media domains, lowercased, each checked; raise ValueError naming a bad one."""
    seen: list[str] = []
    for domain in domains:
        if not isinstance(domain, str) or not _DOMAIN.match(domain.strip().lower()):
            raise ValueError(
                f"invalid media domain {domain!r}: give a host name such as images.example.com "
                "(no scheme, port, path or wildcard)"
            )
        name = domain.strip().lower()
        if name == NO_MEDIA_DOMAIN:
            raise ValueError(f"invalid media domain {domain!r}: a name that never resolves")
        if name not in seen:
            seen.append(name)
    if len(seen) > MAX_MEDIA_DOMAINS:
        raise ValueError(f"too many media domains ({len(seen)}): at most {MAX_MEDIA_DOMAINS}")
    return seen


def engine_media_domains(domains: Iterable[str]) -> list[str]:
    """What an engine's ``--allowed-media-domains`` gets: the policy's domains, or a name
    that never resolves (the engines read an empty list as "every domain")."""
    return list(domains) or [NO_MEDIA_DOMAIN]


# The keys whose strings are media URLs: engines name theirs ``url``, ``image_url``...
_URL_KEYS = ("url", "URL", "Url")


def may_mention_url(body: bytes) -> bool:
    """Whether a JSON body could hold a key ending in one of :data:`_URL_KEYS` (written
    plainly, or with JSON escapes): the bodies that need :func:`check_media` walked."""
    return b"url" in body or b"\\u" in body or b"URL" in body or b"Url" in body


def check_media(body: Any, domains: frozenset[str]) -> None:
    """Raise :class:`RequestRefusedError` for a URL the engine would fetch from outside the
    policy: a string under a key ending in one of :data:`_URL_KEYS` (at any depth) that is
    neither a ``data:`` URL nor an http(s) URL on one of ``domains``."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                place = f"{where}.{key}" if where else str(key)
                if isinstance(value, str):
                    if str(key).endswith(_URL_KEYS) and not _allowed(value, domains):
                        raise _media_refused(place, value, domains)
                elif isinstance(value, dict | list):
                    stack.append((value, place))
        elif isinstance(node, list):
            stack.extend(
                (item, f"{where}[{i}]")
                for i, item in enumerate(node)
                if isinstance(item, dict | list)
            )


def _allowed(url: str, domains: frozenset[str]) -> bool:
    if url[:5].lower() == "data:":
        return True
    if not domains or not url.isascii() or any(ch <= " " or ch == "\\" for ch in url):
        return False
    try:
        parts = urlsplit(url)
        _ = parts.port  # a malformed port raises here
    except ValueError:
        return False
    if parts.scheme.lower() not in ("http", "https") or "@" in parts.netloc:
        return False
    return (parts.hostname or "") in domains


def _media_refused(place: str, url: str, domains: frozenset[str]) -> RequestRefusedError:
    shown = url if len(url) <= 60 else url[:57] + "..."
    allowed = (
        f"only data: URLs and http(s) URLs on {', '.join(sorted(domains))}"
        if domains
        else "only data: URLs (it lists no media domains)"
    )
    return RequestRefusedError(
        f"Invalid '{place}': {shown!r} is not allowed by this model's media policy "
        f"({MEDIA_POLICY}): {allowed}.",
        place,
        "media_url_not_allowed",
    )
