"""API keys as the gateway sees them: looked up by id, checked by HMAC, cached briefly.

An entry is trusted for at most ``TTL_SECONDS``, so a revoked key stops working on every
process within a second without a database query per request. A key's limits are the
tighter of its own and its user's ceilings, read with it, so narrowing a user narrows
the keys they already have within the same second.

A key's expiry (its own, or its user's longest key lifetime) is kept with it and checked
at each request, so a key stops working when it expires even while the database does
not answer and the last value read stands.

Guessing costs the guesser, not the database: a key that is not exactly the shape this
server makes is refused before any lookup; ids found missing are remembered as missing
for a few seconds and never re-read in the background; lookups that arrive together
share one query; and a client address whose checks keep failing (in a bounded table) is
slowed down: its failures are answered 429 (with ``Retry-After``), and a key of its that
is not in memory waits for the cache's slow lane (one shared read every
``SLOW_LANE_SECONDS``). A real key always gets in, throttled or not.

The refusal does not tell whether the id exists: an unknown id's secret is compared with
a stand-in HMAC, the same work as a wrong secret's, and a refusal answered from memory
waits as long as a read takes lately, so it is no quicker than one that needed a read.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from capyctl.access.classes import BATCH
from capyctl.access.guessing import MISS_SECONDS, FailureThrottle, address_key, client_ip
from capyctl.access.models import ApiKey
from capyctl.access.services import NO_KEY_HMAC, expires_at, split_key
from capyctl.gateway.cache import WarmCache
from capyctl.gateway.errors import GatewayError
from capyctl.secret_hashing import hash_secret

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
    active: bool  # not revoked, its user active (both change only by a database write)
    models: frozenset[int] | None  # None: every deployment
    requests_per_minute: int | None
    user_id: int  # required: usage, stored responses and the user's buckets key on it
    max_concurrent: int | None = None
    user_requests_per_minute: int | None = None
    user_max_concurrent: int | None = None
    expires_at: float | None = None  # time.time() it stops working at (None: never)
    team_id: int | None = None  # the team it is charged to
    batch: bool = False  # its class (its own, else its team's) is batch

    def allows(self, ref: int) -> bool:
        """Whether it may use the deployment ``ref`` (its id) or the adapter (its
        :meth:`~capyctl.deployments.models.Adapter.ref`): an allowlist names each apart."""
        return self.models is None or ref in self.models

    def works(self, now: float) -> bool:
        """Whether the key may be used at ``now`` (time.time()): checked at each request,
        so time stops it even while its info cannot be re-read."""
        return self.active and (self.expires_at is None or now < self.expires_at)


# What an unknown id's secret is checked against: the same work as a real key's.
_NO_KEY = KeyInfo(pk=0, key_id="", secret_hmac=NO_KEY_HMAC, active=False, models=frozenset(),
                  requests_per_minute=None, user_id=0)  # fmt: skip


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _info(key: ApiKey) -> KeyInfo:
    limits = getattr(key.user, "limits", None)  # no row: no ceilings
    models: frozenset[int] | None = None  # every deployment, unless the key is limited
    if key.limit_models:  # to these only: none left (all removed) means none
        models = frozenset(
            [
                *(m.pk for m in key.allowed_models.all()),
                *(a.ref for a in key.allowed_adapters.all()),
            ]
        )
    user_rpm = user_concurrent = None
    if limits is not None:
        if limits.models_limited:
            ceiling = frozenset(
                [
                    *(m.pk for m in limits.allowed_models.all()),
                    *(a.ref for a in limits.allowed_adapters.all()),
                ]
            )
            models = ceiling if models is None else models & ceiling
        user_rpm, user_concurrent = limits.requests_per_minute, limits.max_concurrent
    ends = expires_at(key)  # a lifetime set after the key was made binds it too
    return KeyInfo(
        pk=key.pk,
        key_id=key.key_id,
        secret_hmac=key.secret_hmac,
        active=key.revoked_at is None and key.user.is_active,
        models=models,
        requests_per_minute=_tighter(key.requests_per_minute, user_rpm),
        user_id=key.user_id,
        max_concurrent=_tighter(key.max_concurrent, user_concurrent),
        user_requests_per_minute=user_rpm,
        user_max_concurrent=user_concurrent,
        expires_at=None if ends is None else ends.timestamp(),
        team_id=key.team_id,
        batch=key.effective_class == BATCH,
    )


def _fetch_many(key_ids: list[str]) -> dict[str, KeyInfo]:
    keys = (
        ApiKey.objects.filter(key_id__in=key_ids)
        .select_related("user", "user__limits", "team")
        .prefetch_related(
            "allowed_models",
            "allowed_adapters",
            "user__limits__allowed_models",
            "user__limits__allowed_adapters",
        )
    )
    return {key.key_id: _info(key) for key in keys}


def client_address(client: Any, headers: Iterable[tuple[bytes, bytes]] | None = None) -> str:
    """The ASGI scope's ``client`` as the throttle counts it ('' when unknown): behind a
    trusted proxy (``TRUSTED_PROXIES``), the address its ``X-Forwarded-For`` gives."""
    peer = str(client[0]) if client else ""
    forwarded = None
    if headers is not None and settings.CAPYCTL["TRUSTED_PROXIES"]:
        hops = [value for name, value in headers if name.lower() == b"x-forwarded-for"]
        forwarded = b",".join(hops).decode("latin-1") if hops else None
    return address_key(client_ip(peer, forwarded))


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
            keep_warm=float(settings.CAPYCTL["KEY_KEEP_WARM_SECONDS"]),
        )
        self.failures = FailureThrottle()
        # The HMAC of each secret that matched lately: the check is then a dict lookup and
        # a constant-time compare. Kept in memory only, like the key infos themselves.
        self._digests: dict[str, str] = {}

    async def close(self) -> None:
        await self._infos.close()

    async def check(
        self,
        full_key: str,
        client: Any = None,
        headers: Iterable[tuple[bytes, bytes]] | None = None,
    ) -> KeyInfo | None:
        """The key's info if ``full_key`` is a valid key that works now; else None.
        ``client`` and ``headers`` are the ASGI scope's: an address over its failures has
        a key not in memory read in the slow lane, and gets :func:`too_many_failures`
        raised for anything but a valid key."""
        began = time.monotonic()
        address = client_address(client, headers)
        wait = self.failures.wait(address)
        parts = split_key(full_key)
        if parts is not None:
            key_id, secret = parts
            info = await self._infos.get(key_id, slow=bool(wait))
            # An unknown id is compared too, with a stand-in: the same work either way.
            matches = self._matches(info or _NO_KEY, secret)
            if matches and info is not None and info.works(time.time()):
                return info
        # Answered no sooner than a read would be: how quick a refusal is must not tell
        # whether its id was in memory (in use) or had to be looked for.
        spent = time.monotonic() - began
        if spent < self._infos.read_seconds:
            await asyncio.sleep(self._infos.read_seconds - spent)
        wait = self.failures.wait(address)  # less now, if the slow lane was waited for
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
