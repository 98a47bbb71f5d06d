"""Static files (admin CSS/JS, dashboard assets) served by a small ASGI app.

It sits in front of Django so asset requests never take Django's synchronous view path,
and it needs no ``collectstatic``: files are found with Django's staticfiles finders.
``/favicon.ico``, which browsers ask for on every site whatever a page links, is served
the same way from ``capyctl/favicon.ico``.
"""

from __future__ import annotations

import asyncio
import mimetypes
from email.utils import formatdate
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.staticfiles import finders

Scope = dict[str, Any]
Receive = Any
Send = Any

# Paths outside ``STATIC_URL`` that are static files all the same: path -> the file's name
# under the static directories.
FIXED_PATHS = {"/favicon.ico": "capyctl/favicon.ico"}


class StaticFilesApp:
    """Serve ``GET``/``HEAD`` for files under ``STATIC_URL`` with validators and caching."""

    def __init__(self) -> None:
        self.prefix = settings.STATIC_URL
        self._found: dict[str, Path | None] = {}

    def handles(self, scope: Scope) -> bool:
        path = str(scope["path"])
        return scope["type"] == "http" and (path.startswith(self.prefix) or path in FIXED_PATHS)

    def _relative(self, path: str) -> str:
        return FIXED_PATHS.get(path) or path[len(self.prefix) :]

    def _find(self, relative: str) -> Path | None:
        if relative not in self._found:
            if not relative or ".." in Path(relative).parts or relative.startswith("/"):
                self._found[relative] = None
            else:
                found = finders.find(relative)
                self._found[relative] = Path(found) if isinstance(found, str) else None
        return self._found[relative]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        if method not in ("GET", "HEAD"):
            await _respond(send, 405, b"method not allowed\n", [(b"allow", b"GET, HEAD")])
            return
        path = self._find(self._relative(str(scope["path"])))
        if path is None or not path.is_file():
            await _respond(send, 404, b"not found\n")
            return
        stat = path.stat()
        etag = f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'.encode()
        headers = [
            (b"etag", etag),
            (b"last-modified", formatdate(stat.st_mtime, usegmt=True).encode()),
            (b"cache-control", b"public, max-age=3600"),
        ]
        request_headers = dict(scope.get("headers") or [])
        if request_headers.get(b"if-none-match") == etag:
            await _respond(send, 304, b"", headers)
            return
        content_type, encoding = mimetypes.guess_type(path.name)
        headers.append((b"content-type", (content_type or "application/octet-stream").encode()))
        if encoding:
            headers.append((b"content-encoding", encoding.encode()))
        body = b"" if method == "HEAD" else await asyncio.to_thread(path.read_bytes)
        headers.append((b"content-length", str(stat.st_size).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    all_headers = [(b"content-type", b"text/plain; charset=utf-8"), *(headers or [])]
    all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})
