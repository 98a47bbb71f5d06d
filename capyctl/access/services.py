"""Users and API keys: issuing, checking and revoking.

A key is ``capy_<key_id>_<secret>``. Only ``HMAC-SHA256(server secret, secret)`` is
stored; lookup is by ``key_id`` and the HMAC is compared in constant time, so checking a
key costs microseconds (no slow password hasher on the request path).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import string
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from capyctl.access.models import ApiKey
from capyctl.deployments.services import get_deployment
from capyctl.errors import NotFoundError, UserError
from capyctl.events.services import record_event
from capyctl.validation import validate_name

KEY_PREFIX = "capy_"
_KEY_ID_ALPHABET = string.ascii_lowercase + string.digits
_KEY_ID_LENGTH = 10
MAX_RATE = 2**31 - 1  # requests per minute; the column is 32-bit


@functools.lru_cache(maxsize=4)
def _hmac_key(server_secret: str) -> bytes:
    # A key of its own, derived from the server secret, so the HMAC cannot be confused
    # with any other use of SECRET_KEY. Derived once: every /v1 request checks a key.
    return hmac.new(server_secret.encode(), b"capyctl api key v1", hashlib.sha256).digest()


def hash_secret(secret: str) -> str:
    return hmac.new(_hmac_key(settings.SECRET_KEY), secret.encode(), hashlib.sha256).hexdigest()


def split_key(full_key: str) -> tuple[str, str] | None:
    """``capy_<id>_<secret>`` → ``(id, secret)``, or ``None`` if it is not of that form."""
    if not full_key.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = full_key[len(KEY_PREFIX) :].partition("_")
    if not sep or len(key_id) != _KEY_ID_LENGTH or not secret:
        return None
    return key_id, secret


def get_user(username: str) -> User:
    try:
        return User.objects.get(username=username)
    except User.DoesNotExist:
        raise NotFoundError(f"no user named {username!r}", field="user") from None


@transaction.atomic
def add_user(
    username: str, *, password: str | None = None, staff: bool = False, actor: str = ""
) -> User:
    """Create a user. Without a password the account cannot log in until one is set."""
    validate_name(username, what="user name", field="username")
    if User.objects.filter(username=username).exists():
        raise UserError(f"a user named {username!r} already exists", field="username")
    user = User.objects.create_user(
        username=username, password=password, is_staff=staff, is_superuser=staff
    )
    record_event(
        "user.added",
        f"user {username} added{' (staff)' if staff else ''}",
        subject=username,
        actor=actor,
    )
    return user


@transaction.atomic
def issue_api_key(
    username: str,
    *,
    name: str = "",
    models: list[str] | None = None,
    expires_in: timedelta | None = None,
    admin: bool = False,
    requests_per_minute: int | None = None,
    actor: str = "",
) -> tuple[ApiKey, str]:
    """Make a key for ``username``. Returns the row and the full key, which is shown once."""
    user = get_user(username)
    deployments = [get_deployment(model) for model in models or []]
    if admin and not user.is_staff:
        raise UserError(
            f"user {username!r} is not staff, so their keys cannot have the admin scope",
            field="admin",
        )
    if requests_per_minute is not None and not 1 <= requests_per_minute <= MAX_RATE:
        raise UserError(f"requests per minute must be 1 to {MAX_RATE}", field="requests_per_minute")
    if len(name) > 100:
        raise UserError("a key name is at most 100 characters", field="name")
    key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(_KEY_ID_LENGTH))
    while ApiKey.objects.filter(key_id=key_id).exists():  # pragma: no cover - 36^10 space
        key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(_KEY_ID_LENGTH))
    secret = secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        key_id=key_id,
        secret_hmac=hash_secret(secret),
        user=user,
        name=name,
        is_admin=admin,
        requests_per_minute=requests_per_minute,
        expires_at=timezone.now() + expires_in if expires_in else None,
    )
    key.allowed_models.set(deployments)
    record_event(
        "key.created",
        f"API key {key.prefix} created for {username}"
        + (f" (models: {', '.join(d.name for d in deployments)})" if deployments else ""),
        subject=key.prefix,
        actor=actor,
    )
    return key, f"{KEY_PREFIX}{key_id}_{secret}"


def find_api_key(full_key: str) -> ApiKey | None:
    """The active key matching ``full_key``, or ``None`` (unknown, revoked or expired)."""
    parts = split_key(full_key)
    if parts is None:
        return None
    key_id, secret = parts
    key = ApiKey.objects.filter(key_id=key_id).select_related("user").first()
    if key is None or not hmac.compare_digest(key.secret_hmac, hash_secret(secret)):
        return None
    if not key.is_active() or not key.user.is_active:
        return None
    return key


def get_api_key(ident: str) -> ApiKey:
    """A key by its id (``k3j…``) or prefix (``capy_k3j…``); a full key works too."""
    key_id = ident
    if ident.startswith(KEY_PREFIX):
        key_id = ident[len(KEY_PREFIX) :].partition("_")[0]
    key = ApiKey.objects.filter(key_id=key_id).first()
    if key is None:
        raise NotFoundError(f"no API key with id {ident!r}", field="id")
    return key


@transaction.atomic
def revoke_api_key(ident: str, *, actor: str = "") -> ApiKey:
    """Revoke a key. Revoking twice is harmless and keeps the first time."""
    key = get_api_key(ident)
    if key.revoked_at is None:
        ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        key.refresh_from_db()
        record_event(
            "key.revoked", f"API key {key.prefix} revoked", subject=key.prefix, actor=actor
        )
    return key


UNCHANGED = object()  # "leave this setting as it is" (None has a meaning: no limit)


@transaction.atomic
def update_api_key(
    ident: str,
    *,
    name: str | None = None,
    models: list[str] | None = None,
    requests_per_minute: int | object | None = UNCHANGED,
    actor: str = "",
) -> ApiKey:
    """Change a key's label, allowed models or rate limit (its secret never changes)."""
    key = get_api_key(ident)
    changed = []
    if name is not None:
        if len(name) > 100:
            raise UserError("a key name is at most 100 characters", field="name")
        key.name = name
        changed.append("name")
    if requests_per_minute is not UNCHANGED:
        if requests_per_minute is not None and (
            not isinstance(requests_per_minute, int) or not 1 <= requests_per_minute <= MAX_RATE
        ):
            raise UserError(
                f"requests per minute must be 1 to {MAX_RATE}", field="requests_per_minute"
            )
        key.requests_per_minute = requests_per_minute
        changed.append("requests per minute")
    deployments = [get_deployment(model) for model in models] if models is not None else None
    key.save()
    if deployments is not None:
        key.allowed_models.set(deployments)
        changed.append("models")
    record_event(
        "key.changed",
        f"API key {key.prefix} changed: {', '.join(changed) or 'nothing'}",
        subject=key.prefix,
        actor=actor,
    )
    return key


@transaction.atomic
def update_user(
    username: str,
    *,
    password: str | None = None,
    staff: bool | None = None,
    active: bool | None = None,
    actor: str = "",
) -> User:
    """Set a user's password, staff flag or active flag. An inactive user's keys stop
    working at once (they are checked with the user on every lookup)."""
    user = get_user(username)
    if username == actor and (staff is False or active is False):
        raise UserError(
            "you cannot take away your own staff rights or deactivate yourself",
            field="staff" if staff is False else "active",
        )
    changed = []
    if password is not None:
        if len(password) < 8:
            raise UserError("a password is at least 8 characters", field="password")
        user.set_password(password)
        changed.append("password")
    if staff is not None:
        user.is_staff = user.is_superuser = staff
        changed.append("staff" if staff else "not staff")
    if active is not None:
        user.is_active = active
        changed.append("active" if active else "inactive")
    user.save()
    record_event(
        "user.changed",
        f"user {username} changed: {', '.join(changed) or 'nothing'}",
        subject=username,
        actor=actor,
    )
    return user


@transaction.atomic
def remove_user(username: str, *, actor: str = "") -> None:
    """Delete a user and their keys."""
    user = get_user(username)
    if username == actor:
        raise UserError("you cannot remove your own user", field="username")
    user.delete()
    record_event("user.removed", f"user {username} removed", subject=username, actor=actor)
