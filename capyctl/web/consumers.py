"""The dashboard's WebSocket, ``/ws/dashboard/``: a snapshot on connect, then each change.

Only a logged-in, active staff user may listen. That is checked on connect and again
before every snapshot (from the database, not the session cached on the socket), so a
user who logs out, is deactivated or loses staff status is cut off within a second with
close code 4403.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib import auth
from django.http import HttpRequest

from capyctl.events.services import DASHBOARD_GROUP, dashboards_listen_on
from capyctl.web.dashboard import dashboard_data

logger = logging.getLogger("capyctl.web")

POLL_SECONDS = 1.0
CLOSE_FORBIDDEN = 4403


def staff_session(session_key: str | None) -> bool:
    """Whether ``session_key`` names a live session of an active staff user, read afresh."""
    if not session_key:
        return False
    engine = import_module(settings.SESSION_ENGINE)
    request = HttpRequest()
    request.session = engine.SessionStore(session_key)
    # Django's own check: the session exists and has not expired, its user exists and may
    # log in, and the password has not changed since (the session's auth hash).
    user = auth.get_user(request)
    return bool(user.is_authenticated and user.is_active and user.is_staff)


def _snapshot(session_key: str | None) -> dict[str, Any] | None:
    """The dashboard's data, or None when the session may no longer see it."""
    if not staff_session(session_key):
        return None
    return dashboard_data()


_allowed = database_sync_to_async(staff_session, thread_sensitive=False)
_read = database_sync_to_async(_snapshot, thread_sensitive=False)


class DashboardConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    """Sends ``{"type": "snapshot", "data": dashboard_data()}`` on connect and whenever
    the data changed: it re-reads every second, and at once when an event is recorded
    (a ``dashboard.changed`` message on the ``capyctl-dashboard`` group). Several
    messages in a burst cost one read."""

    async def connect(self) -> None:
        self._session_key: str | None = self.scope.get("cookies", {}).get(
            settings.SESSION_COOKIE_NAME
        )
        self._last: dict[str, Any] | None = None
        self._changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._joined = False
        # Accept first, then close: a refused handshake reaches the browser as 1006, and
        # the page must tell "logged out" (stop) from "connection lost" (retry).
        await self.accept()
        if not await _allowed(self._session_key):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        dashboards_listen_on(asyncio.get_running_loop())
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        self._joined = True
        self._changed.set()  # the first snapshot, at once
        self._watcher = asyncio.create_task(self._watch())

    async def disconnect(self, code: int) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._joined:
            await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    async def dashboard_changed(self, message: dict[str, Any]) -> None:
        """A ``dashboard.changed`` group message: re-read now rather than at the next poll."""
        self._changed.set()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The page sends nothing; anything it does send is ignored."""

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=POLL_SECONDS)
            self._changed.clear()
            try:
                if not await self._send_if_changed():
                    return
            except Exception:  # a failed read (a locked database) must not end the feed
                logger.exception("dashboard snapshot failed")

    async def _send_if_changed(self) -> bool:
        """Send the data if it changed; False (and the socket closed) once not allowed."""
        data = await _read(self._session_key)
        if data is None:
            await self.close(code=CLOSE_FORBIDDEN)
            return False
        if data != self._last:
            self._last = data
            await self.send_json({"type": "snapshot", "data": data})
        return True
