"""API keys as the gateway sees them: looked up by id, checked by HMAC, cached briefly.

An entry is trusted for at most ``TTL_SECONDS``, so a revoked key stops working on every
process within a second without a database query per request.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from django.utils import timezone

from capyctl.access.models import ApiKey
from capyctl.access.services import hash_secret, split_key
from capyctl.gateway.cache import WarmCache

# Keys in use are re-read every SOFT seconds in the background; one older than HARD is
# never trusted (so a revoked key stops working within a second).
SOFT_TTL_SECONDS = 0.4
TTL_SECONDS = 1.0
_DIGESTS_KEPT = 10_000


@dataclass(frozen=True)
class KeyInfo:
    pk: int
    key_id: str
    secret_hmac: str
    active: bool
    models: frozenset[int]  # empty: every deployment
    requests_per_minute: int | None

    def allows(self, deployment_id: int) -> bool:
        return not self.models or deployment_id in self.models


def _fetch_many(key_ids: list[str]) -> dict[str, KeyInfo]:
    now = timezone.now()
    keys = (
        ApiKey.objects.filter(key_id__in=key_ids)
        .select_related("user")
        .prefetch_related("allowed_models")
    )
    return {
        key.key_id: KeyInfo(
            pk=key.pk,
            key_id=key.key_id,
            secret_hmac=key.secret_hmac,
            active=key.is_active(now) and key.user.is_active,
            models=frozenset(m.pk for m in key.allowed_models.all()),
            requests_per_minute=key.requests_per_minute,
        )
        for key in keys
    }


class KeyCache:
    """Key infos by id, kept warm (see :class:`WarmCache`): a revoked key stops working
    within ``TTL_SECONDS`` on every process, with no database query per request."""

    def __init__(self) -> None:
        self._infos: WarmCache[KeyInfo] = WarmCache(
            _fetch_many, soft=SOFT_TTL_SECONDS, hard=TTL_SECONDS
        )
        # The HMAC of each secret presented lately: the check is then a dict lookup and a
        # constant-time compare. Kept in memory only, like the key infos themselves.
        self._digests: dict[str, str] = {}

    async def close(self) -> None:
        await self._infos.close()

    async def check(self, full_key: str) -> KeyInfo | None:
        """The key's info if ``full_key`` is a valid, active key; else None."""
        parts = split_key(full_key)
        if parts is None:
            return None
        key_id, secret = parts
        info = await self._infos.get(key_id)
        if info is None or not info.active:
            return None
        digest = self._digests.get(secret)
        if digest is None:
            digest = hash_secret(secret)
            if len(self._digests) >= _DIGESTS_KEPT:
                self._digests.clear()
            self._digests[secret] = digest
        if not hmac.compare_digest(info.secret_hmac, digest):
            return None
        return info
