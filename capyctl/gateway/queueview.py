"""The queues as other processes see them: what ``capyctl status`` shows of requests that
wait, and of models that wait for room.

The process that serves ``/v1`` publishes its queues while any request waits (every
second, and once more as soon as the last one leaves): each model's waiting requests and,
for a model that waits for room on its host, since when and for which GPUs. Standalone
writes them to ``queues.json`` in the data dir; server mode puts each API process's view
in a Redis hash. Either way a view not renewed for :data:`STALE_SECONDS` was left by a
process that is gone, and counts no more.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings

FILE = "queues.json"
_KEY = "capyctl:queues"
PUBLISH_SECONDS = 1.0
STALE_SECONDS = 5.0

_client: Any = None
_client_lock = threading.Lock()


def _redis() -> Any:
    """One Redis client a process (server mode only)."""
    global _client  # noqa: PLW0603 - made on first use
    with _client_lock:
        if _client is None:
            import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

            _client = redis.Redis.from_url(str(settings.REDIS_URL), socket_timeout=1.0)
        return _client


def _file() -> Path:
    return Path(settings.DATA_DIR) / FILE


def publish(view: dict[str, dict[str, Any]], process: str) -> None:
    """``view``: model name -> ``{"waiting": n, "room_since": epoch or None, ...}``."""
    body = json.dumps({"at": time.time(), "models": view})
    if settings.REDIS_URL:
        if view:
            pipe = _redis().pipeline()
            pipe.hset(_KEY, process, body)
            pipe.expire(_KEY, 3600)
            pipe.execute()
        else:
            _redis().hdel(_KEY, process)
        return
    path = _file()
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(body)
    part.replace(path)


def _views() -> list[str]:
    if settings.REDIS_URL:
        import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

        try:
            return [v.decode() for v in _redis().hgetall(_KEY).values()]
        except redis.RedisError:
            return []
    try:
        return [_file().read_text()]
    except OSError:
        return []


def _parse(raw: str, now: float) -> dict[str, dict[str, Any]]:
    """One process's view, checked whole: stale or not a view, nothing (raises)."""
    body = json.loads(raw)
    if now - float(body["at"]) >= STALE_SECONDS:
        return {}  # its process is gone (a live one renews it every second)
    models: dict[str, dict[str, Any]] = {}
    for name, model in dict(body.get("models") or {}).items():
        since = model.get("room_since")
        parsed: dict[str, Any] = {
            "waiting": int(model.get("waiting") or 0),
            "room_since": None if since is None else float(since),
        }
        if model.get("host_id") is not None:
            parsed["host_id"] = int(model["host_id"])
        if model.get("pools") is not None:
            parsed["pools"] = [str(p) for p in model["pools"]]
        models[str(name)] = parsed
    return models


def read() -> dict[str, dict[str, Any]]:
    """Every serving process's queues, merged: model -> ``{"waiting", "room_since"}``
    (and ``host_id``, ``pools`` for a model that waits for room). A view that is not
    whole (not JSON, the wrong types) is left out."""
    now = time.time()
    merged: dict[str, dict[str, Any]] = {}
    for raw in _views():
        try:
            view = _parse(raw, now)
        except (ValueError, TypeError, AttributeError, KeyError):
            continue
        for name, model in view.items():
            into = merged.setdefault(name, {"waiting": 0, "room_since": None})
            into["waiting"] += model["waiting"]
            since = model["room_since"]
            if since is not None and (into["room_since"] is None or since < into["room_since"]):
                into["room_since"] = since
            into.update({k: model[k] for k in ("host_id", "pools") if k in model})
    return merged
