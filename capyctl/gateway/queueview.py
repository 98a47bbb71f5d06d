"""The queues as other processes see them: what ``capyctl status`` shows of requests that
wait, and of models that wait for room.

The process that serves ``/v1`` publishes its queues while any request waits (every
second, and once more when the last one leaves): each model's waiting requests and, for
a model that waits for room on its host, since when. Standalone writes them to
``queues.json`` in the data dir (the file names the process; a process that is gone
publishes nothing); server mode puts each API process's view in a Redis hash, where a
view not renewed for :data:`STALE_SECONDS` counts no more.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from django.conf import settings

FILE = "queues.json"
_KEY = "capyctl:queues"
PUBLISH_SECONDS = 1.0
STALE_SECONDS = 5.0


def _file() -> Path:
    return Path(settings.DATA_DIR) / FILE


def publish(view: dict[str, dict[str, Any]], process: str) -> None:
    """``view``: model name -> ``{"waiting": n, "room_since": epoch or None}``."""
    body = {"pid": os.getpid(), "at": time.time(), "models": view}
    if settings.REDIS_URL:
        import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0)
        try:
            if view:
                client.hset(_KEY, process, json.dumps(body))
                client.expire(_KEY, 3600)
            else:
                client.hdel(_KEY, process)
        finally:
            client.close()
        return
    path = _file()
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps(body))
    part.replace(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read() -> dict[str, dict[str, Any]]:
    """Every serving process's queues, merged: model -> ``{"waiting", "room_since"}``."""
    views: list[dict[str, Any]] = []
    if settings.REDIS_URL:
        import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0)
        try:
            raw = client.hgetall(_KEY)
        except redis.RedisError:
            raw = {}
        finally:
            client.close()
        now = time.time()
        for value in raw.values():
            with contextlib.suppress(ValueError, TypeError):
                body = json.loads(value)
                if now - float(body["at"]) < STALE_SECONDS:
                    views.append(body)
    else:
        with contextlib.suppress(OSError, ValueError):
            body = json.loads(_file().read_text())
            if isinstance(body, dict) and _alive(int(body.get("pid", 0))):
                views.append(body)
    merged: dict[str, dict[str, Any]] = {}
    for body in views:
        for name, model in dict(body.get("models") or {}).items():
            into = merged.setdefault(str(name), {"waiting": 0, "room_since": None})
            into["waiting"] += int(model.get("waiting") or 0)
            for field in ("host_id", "pools"):
                if model.get(field) is not None:
                    into[field] = model[field]
            since = model.get("room_since")
            if since is not None and (into["room_since"] is None or since < into["room_since"]):
                into["room_since"] = float(since)
    return merged
