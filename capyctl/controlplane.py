"""Whether Redis (server mode's broker, channel layer and shared counts) answers, and
since when it does not: what ``capyctl status`` and the dashboard show.

The processes that use Redis notice an outage first; each records it once as an event
(``redis.down``, then ``redis.back``), so whoever reads the state later can say since when.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.conf import settings

from capyctl.events.models import Event
from capyctl.events.services import record_event

logger = logging.getLogger("capyctl.scheduler")

DOWN = "redis.down"
BACK = "redis.back"


def note_outage(down: bool, detail: str = "") -> None:
    """Record that Redis stopped (or started again) answering, unless the last such event
    says so already. Never raises."""
    try:
        last = (
            Event.objects.filter(kind__in=[DOWN, BACK])
            .order_by("-created_at", "-pk")
            .values_list("kind", flat=True)
            .first()
        )
        if down and last != DOWN:
            record_event(
                DOWN,
                "Redis does not answer: ready models keep answering, nothing is parked or "
                f"stopped to make room, switches wait or are refused ({detail})",
                level=Event.Level.WARNING,
            )
        elif not down and last == DOWN:
            record_event(BACK, "Redis answers again: switching works again")
    except Exception as exc:  # the database may be away too; the log says it
        logger.warning("could not record that Redis %s: %s", "is down" if down else "is back", exc)


def state() -> dict[str, Any]:
    """``{"redis": "ok" | "down" | "not used", "since": ISO time or None}``."""
    if not settings.REDIS_URL:
        return {"redis": "not used", "since": None}
    import redis  # noqa: PLC0415 - only with Redis (server mode): standalone never loads it

    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except (redis.RedisError, OSError):
        return {"redis": "down", "since": _down_since()}
    finally:
        client.close()
    return {"redis": "ok", "since": None}


def _down_since() -> str | None:
    last = (
        Event.objects.filter(kind__in=[DOWN, BACK])
        .order_by("-created_at", "-pk")
        .values_list("kind", "created_at")
        .first()
    )
    if last is None or last[0] != DOWN:
        return None
    when: datetime = last[1]
    return when.isoformat()
