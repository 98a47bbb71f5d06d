"""Local stand-ins for the internet in the source tests: a file server (with ranges, and
one that can drop a download half-way) and a minimal Hugging Face Hub endpoint that
``huggingface_hub`` downloads from."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FileServer:
    """Serves ``files`` (path -> bytes) with Range support; ``cut_after`` bytes drops the
    connection of the next full download once, to test resuming."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.cut_after: int | None = None
        self.seconds_per_mib = 0.0  # pace full downloads, to watch their progress
        self.requests: list[tuple[str, str]] = []  # (path, Range header)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append((self.path, self.headers.get("Range", "")))
                body = outer.files.get(self.path)
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                match = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
                if match:
                    start = int(match[1])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                chunk = body[start:]
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                if outer.cut_after is not None and not match:
                    cut, outer.cut_after = outer.cut_after, None
                    self.wfile.write(chunk[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                step = 64 * 1024
                for offset in range(0, len(chunk), step):
                    self.wfile.write(chunk[offset : offset + step])
                    if outer.seconds_per_mib:
                        time.sleep(outer.seconds_per_mib / 16)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeHub(FileServer):
    """Enough of the Hub's API for ``snapshot_download``: repository info, the file tree
    and ``resolve`` downloads. ``repos`` maps ``ORG/NAME`` to its files."""

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.sha = "0123456789abcdef0123456789abcdef01234567"
        files: dict[str, bytes] = {}
        super().__init__(files)
        outer = self
        base = self.server.RequestHandlerClass

        class Hub(base):  # type: ignore[valid-type,misc]
            def _json(self, status: int, data: object, error: str = "") -> None:
                body = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if error:
                    self.send_header("X-Error-Code", error)
                    self.send_header("X-Error-Message", "Repository not found")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _route(self) -> None:
                path = self.path.split("?", 1)[0]
                api = re.match(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
                if api:
                    repo = outer.repos.get(api[1])
                    if repo is None:
                        self._json(401, {"error": "Repository not found"}, "RepoNotFound")
                    elif api[2] == "revision":
                        siblings = [{"rfilename": name} for name in repo]
                        self._json(200, {"id": api[1], "sha": outer.sha, "siblings": siblings})
                    else:
                        self._json(200, [
                            {"type": "file", "path": name, "size": len(data),
                             "oid": hashlib.sha1(data).hexdigest()}  # noqa: S324 - git's blob id
                            for name, data in repo.items()
                        ])  # fmt: skip
                    return
                resolve = re.match(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if resolve and resolve[3] in outer.repos.get(resolve[1], {}):
                    data = outer.repos[resolve[1]][resolve[3]]
                    outer.files[self.path] = data
                    etag = hashlib.sha1(data).hexdigest()  # noqa: S324 - git's blob id
                    if self.command == "HEAD":
                        self.send_response(200)
                        self.send_header("X-Repo-Commit", outer.sha)
                        self.send_header("ETag", f'"{etag}"')
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        return
                    self.extra = {"X-Repo-Commit": outer.sha, "ETag": f'"{etag}"'}
                    super().do_GET()
                    return
                self._json(404, {"error": "Entry not found"}, "EntryNotFound")

            def do_GET(self) -> None:  # noqa: N802
                self._route()

            def do_HEAD(self) -> None:  # noqa: N802
                self._route()

        self.server.RequestHandlerClass = Hub


def point_hub_at(monkeypatch: Any, server: FakeHub) -> None:
    """Make ``huggingface_hub`` (and the engines CapyCTL starts) download from ``server``."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
    monkeypatch.setattr(
        huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
        server.url + "/{repo_id}/resolve/{revision}/{filename}",
    )  # fmt: skip


def process_environ(pid: int) -> dict[str, str]:
    """The environment a running process was started with (``/proc/PID/environ``)."""
    from pathlib import Path

    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = [item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}
