"""The media URLs of a chat request, fetched as vLLM and SGLang fetch them.

Both engines load the image, audio and video URLs of a chat's content parts themselves
(vLLM ``vllm/multimodal/media/connector.py`` ``MediaConnector.load_from_url``, SGLang's
``load_image``/``load_video``/``load_audio``): a ``data:`` URL is decoded, an ``http(s)`` one
is fetched from wherever it points. With ``--allowed-media-domains`` the URL's host must be
one of them, exactly (``url_spec.hostname not in allowed_media_domains`` in vLLM; "exact
hostnames" in SGLang's ``mm`` fields); without it every host is fetched. So a simulated
engine fetches them too, and a test can see whether a request made the GPU host reach out.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import aiohttp

# vLLM's content part types that carry a URL (MM_PARSER_MAP), and its untyped simple forms.
MEDIA_PARTS = ("image_url", "audio_url", "video_url")
FETCH_TIMEOUT_SECONDS = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT is 5 s
MAX_FETCH_BYTES = 1024 * 1024


def media_urls(messages: Any) -> list[str]:
    """The URLs of the content parts of ``messages``, in order."""
    urls: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, dict):
                continue
            for kind in MEDIA_PARTS:
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):
                    urls.append(url)
    return urls


async def load_media(messages: Any, allowed_domains: tuple[str, ...]) -> str | None:
    """Fetch each media URL of ``messages``; why the request fails (None: it does not)."""
    for url in media_urls(messages):
        if url[:5].lower() == "data:":
            continue
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            return "The URL must be either a HTTP, data or file URL."
        if allowed_domains and parts.hostname not in allowed_domains:
            return (
                f"The URL must be from one of the allowed domains: {list(allowed_domains)}. "
                f"Input URL domain: {parts.hostname}"
            )
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_SECONDS)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout, trust_env=False) as session,
                session.get(url, allow_redirects=False) as answer,
            ):
                await answer.content.read(MAX_FETCH_BYTES)
                if answer.status >= 400:
                    return f"Failed to fetch media from URL: HTTP {answer.status} error"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"Failed to fetch media from URL: {type(exc).__name__}"
    return None
