"""API keys as the gateway sees them: looked up by id, checked by HMAC, cached briefly.

An entry is trusted for at most ``TTL_SECONDS``, so a revoked key stops working on every
process within a second without a database query per request.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.utils import timezone

from capyctl.access.models import ApiKey
from capyctl.access.services import hash_secret, split_key

# Past SOFT an entry is refreshed in the background while still used; past HARD (so a
# revoked key stops working within a second) requests wait for the fresh read.
SOFT_TTL_SECONDS = 0.5
TTL_SECONDS = 1.0


@dataclass(frozen=True)
class KeyInfo:
    pk: int
    key_id: str
    secret_hmac: str
    active: bool
    models: frozenset[int]  # empty: every deployment
    requests_per_minute: int | None
    fetched_at: float

    def allows(self, deployment_id: int) -> bool:
        return not self.models or deployment_id in self.models


def _fetch(key_id: str) -> KeyInfo | None:
    key = ApiKey.objects.filter(key_id=key_id).select_related("user").first()
    if key is None:
        return None
    return KeyInfo(
        pk=key.pk,
        key_id=key.key_id,
        secret_hmac=key.secret_hmac,
        active=key.is_active(timezone.now()) and key.user.is_active,
        models=frozenset(key.allowed_models.values_list("pk", flat=True)),
        requests_per_minute=key.requests_per_minute,
        fetched_at=time.monotonic(),
    )


class KeyCache:
    """Key infos by id. A stale entry is refreshed by ONE query while requests keep using
    it for those few milliseconds; a key not seen before waits for its first read."""

    def __init__(self) -> None:
        self._keys: dict[str, KeyInfo | None] = {}
        self._times: dict[str, float] = {}
        self._refreshing: dict[str, asyncio.Task[KeyInfo | None]] = {}

    async def _refresh(self, key_id: str) -> KeyInfo | None:
        try:
            info = await sync_to_async(_fetch, thread_sensitive=False)(key_id)
            self._keys[key_id] = info
            self._times[key_id] = time.monotonic()
            return info
        finally:
            self._refreshing.pop(key_id, None)

    async def _info(self, key_id: str) -> KeyInfo | None:
        age = time.monotonic() - self._times.get(key_id, -1e9)
        if age <= SOFT_TTL_SECONDS:
            return self._keys[key_id]
        task = self._refreshing.get(key_id)
        if task is None:
            task = asyncio.ensure_future(self._refresh(key_id))
            self._refreshing[key_id] = task
        if key_id in self._keys and age <= TTL_SECONDS:
            return self._keys[key_id]  # a little stale while the refresh is under way
        return await asyncio.shield(task)

    async def check(self, full_key: str) -> KeyInfo | None:
        """The key's info if ``full_key`` is a valid, active key; else None."""
        parts = split_key(full_key)
        if parts is None:
            return None
        key_id, secret = parts
        info = await self._info(key_id)
        if info is None or not info.active:
            return None
        if not hmac.compare_digest(info.secret_hmac, hash_secret(secret)):
            return None
        return info
