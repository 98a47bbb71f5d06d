"""The HMAC under which CapyCTL stores the secrets it hands out (API keys, join tokens).

A module of its own, depending on nothing but the settings, so that every app may hash a
secret without importing another app's services.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

from django.conf import settings


@functools.lru_cache(maxsize=4)
def _hmac_key(server_secret: str) -> bytes:
    # A key of its own, derived from the server secret, so the HMAC cannot be confused
    # with any other use of SECRET_KEY. Derived once: every /v1 request checks a key.
    return hmac.new(server_secret.encode(), b"capyctl api key v1", hashlib.sha256).digest()


def hash_secret(secret: str) -> str:
    """The hex HMAC-SHA256 of ``secret``, keyed by (a key derived from) the server secret."""
    return hmac.new(_hmac_key(settings.SECRET_KEY), secret.encode(), hashlib.sha256).hexdigest()
