"""Writing events. Every state change records one, inside the same transaction."""

from __future__ import annotations

import logging
from typing import Any

from capyctl.events.models import Event

logger = logging.getLogger("capyctl.events")

_LOG_LEVELS: dict[str, int] = {
    Event.Level.INFO: logging.INFO,
    Event.Level.WARNING: logging.WARNING,
    Event.Level.ERROR: logging.ERROR,
}


def record_event(
    kind: str,
    message: str,
    *,
    subject: str = "",
    level: str = Event.Level.INFO,
    actor: str = "",
    deployment_id: int | None = None,
    host_id: int | None = None,
    duration_ms: int | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    """Save an Event and log the same line, so logs and ``capyctl events`` agree."""
    event = Event.objects.create(
        kind=kind,
        message=message,
        subject=subject,
        level=level,
        actor=actor,
        deployment_id=deployment_id,
        host_id=host_id,
        duration_ms=duration_ms,
        data=data or {},
    )
    logger.log(_LOG_LEVELS.get(level, logging.INFO), "%s: %s", kind, message)
    return event
