"""API keys as the gateway sees them: looked up by id, checked by HMAC, cached briefly.

An entry is trusted for at most ``TTL_SECONDS``, so a revoked key stops working on every
process within a second without a database query per request. A key's limits are the
tighter of its own and its user's ceilings, read with it, so narrowing a user narrows
the keys they already have within the same second.

Guessing costs the guesser, not the database: a key that is not exactly the shape this
server makes is refused before any lookup; ids found missing are remembered as missing
for a few seconds and never re-read in the background; lookups that arrive together
share one query; and a client address whose checks keep failing is answered 429 (with
``Retry-After``) for anything but a valid key already in memory, in a bounded table.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from capyctl.access.guessing import MISS_SECONDS, FailureThrottle, address_key
from capyctl.access.models import ApiKey
from capyctl.access.services import hash_secret, split_key
from capyctl.gateway.cache import WarmCache
from capyctl.gateway.errors import GatewayError

# Keys in use are re-read every SOFT seconds in the background; one older than HARD is
# never trusted (so a revoked key stops working within a second).
SOFT_TTL_SECONDS = 0.4
TTL_SECONDS = 1.0
KEYS_KEPT = 10_000  # warm key ids, and ids remembered as missing, each at most
_DIGESTS_KEPT = 10_000


@dataclass(frozen=True)
class KeyInfo:
    """A key as the gateway uses it. Limits are the tighter of the key's and its user's
    (None: no limit); ``user_*`` are the user's ceilings, which all their keys share."""

    pk: int
    key_id: str
    secret_hmac: str
    active: bool
    models: frozenset[int] | None  # None: every deployment
    requests_per_minute: int | None
    user_id: int  # required: usage, stored responses and the user's buckets key on it
    max_concurrent: int | None = None
    user_requests_per_minute: int | None = None
    user_max_concurrent: int | None = None

    def allows(self, deployment_id: int) -> bool:
        return self.models is None or deployment_id in self.models


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _info(key: ApiKey, now: Any) -> KeyInfo:
    limits = getattr(key.user, "limits", None)  # no row: no ceilings
    models: frozenset[int] | None = None  # every deployment, unless the key is limited
    if key.limit_models:  # to these only: none left (all removed) means none
        models = frozenset(m.pk for m in key.allowed_models.all())
    active = key.is_active(now) and key.user.is_active
    user_rpm = user_concurrent = None
    if limits is not None:
        if limits.models_limited:
            ceiling = frozenset(m.pk for m in limits.allowed_models.all())
            models = ceiling if models is None else models & ceiling
        if limits.key_lifetime is not None and key.created_at + limits.key_lifetime <= now:
            active = False  # a lifetime set after the key was made binds it too
        user_rpm, user_concurrent = limits.requests_per_minute, limits.max_concurrent
    return KeyInfo(
        pk=key.pk,
        key_id=key.key_id,
        secret_hmac=key.secret_hmac,
        active=active,
        models=models,
        requests_per_minute=_tighter(key.requests_per_minute, user_rpm),
        user_id=key.user_id,
        max_concurrent=_tighter(key.max_concurrent, user_concurrent),
        user_requests_per_minute=user_rpm,
        user_max_concurrent=user_concurrent,
    )


def _fetch_many(key_ids: list[str]) -> dict[str, KeyInfo]:
    now = timezone.now()
    keys = (
        ApiKey.objects.filter(key_id__in=key_ids)
        .select_related("user", "user__limits")
        .prefetch_related("allowed_models", "user__limits__allowed_models")
    )
    return {key.key_id: _info(key, now) for key in keys}


def client_address(client: Any) -> str:
    """The ASGI scope's ``client`` as the throttle counts it ('' when unknown)."""
    return address_key(str(client[0])) if client else ""


def too_many_failures(wait: float) -> GatewayError:
    return GatewayError(
        429,
        "too_many_failed_keys",
        "Too many requests with invalid API keys from this address; retry later.",
        "rate_limit_error",
        headers=[(b"retry-after", str(int(wait + 0.999)).encode())],
    )


class KeyCache:
    """Key infos by id, kept warm (see :class:`WarmCache`): a revoked key stops working
    within ``TTL_SECONDS`` on every process, with no database query per request."""

    def __init__(self) -> None:
        self._infos: WarmCache[KeyInfo] = WarmCache(
            _fetch_many,
            soft=SOFT_TTL_SECONDS,
            hard=TTL_SECONDS,
            max_names=KEYS_KEPT,
            warm_missing=False,
            miss_seconds=MISS_SECONDS,
        )
        self.failures = FailureThrottle()
        # The HMAC of each secret that matched lately: the check is then a dict lookup and
        # a constant-time compare. Kept in memory only, like the key infos themselves.
        self._digests: dict[str, str] = {}

    async def close(self) -> None:
        await self._infos.close()

    async def check(self, full_key: str, client: Any = None) -> KeyInfo | None:
        """The key's info if ``full_key`` is a valid, active key; else None. ``client`` is
        the ASGI scope's: an address over its failures gets :func:`too_many_failures`
        raised for anything but a valid key already in memory."""
        address = client_address(client)
        wait = self.failures.wait(address)
        parts = split_key(full_key)
        if parts is not None:
            key_id, secret = parts
            info = self._infos.peek(key_id)[1] if wait else await self._infos.get(key_id)
            if info is not None and info.active and self._matches(info, secret):
                return info
        if wait:
            raise too_many_failures(wait)
        self.failures.failed(address)
        return None

    def _matches(self, info: KeyInfo, secret: str) -> bool:
        digest = self._digests.get(secret)
        if digest is not None:
            return hmac.compare_digest(info.secret_hmac, digest)
        digest = hash_secret(secret)
        if not hmac.compare_digest(info.secret_hmac, digest):
            return False
        if len(self._digests) >= _DIGESTS_KEPT:
            self._digests.clear()
        self._digests[secret] = digest
        return True
