"""Writing and reading events. Every state change records one, inside the same transaction.

Once an event is committed, open dashboards are told (the ``capyctl-dashboard`` group on
the Channels layer), so a change shows at once rather than at their next poll.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.db import transaction
from django.db.models import QuerySet

from capyctl.events.models import Event
from capyctl.prepared import PreparedInsert

logger = logging.getLogger("capyctl.events")

DASHBOARD_GROUP = "capyctl-dashboard"
_INSERT = PreparedInsert(Event)  # every state change writes one: its SQL built once
_dashboard_loop: asyncio.AbstractEventLoop | None = None

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
    event: Event = _INSERT(
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
    transaction.on_commit(tell_dashboards)
    return event


def latest_events(limit: int, *, subject: str | None = None) -> list[Event]:
    """The ``limit`` events written last (about ``subject``, where given), oldest first:
    by id, the order they were written in, which :func:`events_after` goes on from."""
    return list(_about(subject).order_by("-id")[:limit])[::-1]


def events_after(event_id: int, *, subject: str | None = None) -> list[Event]:
    """The events written after the event ``event_id`` (about ``subject``), oldest first."""
    return list(_about(subject).filter(pk__gt=event_id).order_by("id"))


def _about(subject: str | None) -> QuerySet[Event]:
    return Event.objects.filter(subject=subject) if subject else Event.objects.all()


def dashboards_listen_on(loop: asyncio.AbstractEventLoop) -> None:
    """Called by dashboard consumers with the event loop they run on.

    The in-memory channel layer (standalone) keeps its queues on that loop and is not
    thread-safe, so messages from other threads (scheduler workers) are sent from there.
    """
    global _dashboard_loop  # noqa: PLW0603 - one serving loop per process
    _dashboard_loop = loop


def tell_dashboards() -> None:
    """Tell open dashboards that something changed. Best effort and quick: it never
    raises, and a dashboard that misses it still sees the change at its next poll."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return  # sync code on an event loop's thread: no safe way to wait on a send here
    message = {"type": "dashboard.changed"}
    try:
        layer = get_channel_layer()
        if layer is None:
            return
        if isinstance(layer, InMemoryChannelLayer):
            loop = _dashboard_loop
            if loop is None or loop.is_closed() or not loop.is_running():
                return  # no dashboard has connected to this process
            # The send is made on that loop (and its coroutine only there, so a loop that
            # stops first leaves nothing half-started behind).
            loop.call_soon_threadsafe(_send_on_loop, layer, message)
        else:
            async_to_sync(layer.group_send)(DASHBOARD_GROUP, message)
    except Exception as exc:  # the event is saved; the dashboards' poll catches up
        logger.debug("could not tell dashboards about a change: %s", exc)


_sending: set[asyncio.Task[None]] = set()


def _send_on_loop(layer: InMemoryChannelLayer, message: dict[str, str]) -> None:
    task = asyncio.get_running_loop().create_task(layer.group_send(DASHBOARD_GROUP, message))
    _sending.add(task)  # a reference until it is done, so it is not collected half-way
    task.add_done_callback(_sent)


def _sent(task: asyncio.Task[None]) -> None:
    _sending.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.debug("could not tell dashboards about a change: %s", task.exception())
