"""Users and API keys: issuing, checking and revoking.

A key is ``capy_<key_id>_<secret>``. Only ``HMAC-SHA256(server secret, secret)`` is
stored; lookup is by ``key_id`` and the HMAC is compared in constant time, so checking a
key costs microseconds (no slow password hasher on the request path).
"""

from __future__ import annotations

import hmac
import re
import secrets
import string
import time
from datetime import datetime, timedelta
from typing import Any, cast

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from capyctl.access.classes import CLASSES
from capyctl.access.guessing import RecentMisses
from capyctl.access.models import ApiKey, Ceilings, Team, UserLimits
from capyctl.deployments.models import Adapter, Deployment
from capyctl.deployments.services import get_deployment
from capyctl.errors import NotFoundError, UserError
from capyctl.events.services import record_event
from capyctl.secret_hashing import hash_secret
from capyctl.validation import validate_name

KEY_PREFIX = "capy_"
_KEY_ID_ALPHABET = string.ascii_lowercase + string.digits
_KEY_ID_LENGTH = 10
_SECRET_BYTES = 32
# Exactly what issue_api_key makes: anything else is refused before any lookup.
_KEY_FORM = re.compile(r"capy_([a-z0-9]{10})_([A-Za-z0-9_-]{43})")
# What a secret is compared with when its id does not exist: no secret's HMAC (random, of
# the same length), so that path does the work a wrong secret's does.
NO_KEY_HMAC = secrets.token_hex(32)
MAX_RATE = 2**31 - 1  # requests per minute; the column is 32-bit
MAX_LIFETIME = timedelta(days=100 * 365)


def split_key(full_key: str) -> tuple[str, str] | None:
    """``capy_<id>_<secret>`` → ``(id, secret)``, or ``None`` unless it has exactly the
    alphabet and lengths of a key this server makes."""
    match = _KEY_FORM.fullmatch(full_key)
    return None if match is None else (match[1], match[2])


def get_user(username: str) -> User:
    try:
        return User.objects.get(username=username)
    except User.DoesNotExist:
        raise NotFoundError(f"no user named {username!r}", field="user") from None


def get_team(name: str) -> Team:
    found = Team.objects.filter(name=name).first()
    if found is None:
        raise NotFoundError(f"no team named {name!r}", field="team")
    return found


def team_for_key(user: User, name: str | None) -> Team | None:
    """The team a key of ``user`` is charged to (None: none): one the user is a member of."""
    if not name:
        return None
    team = get_team(name)
    if not team.members.filter(pk=user.pk).exists():
        raise UserError(
            f"{user.get_username()} is not a member of team {name}; a key is charged only to "
            "a team of its user's",
            field="team",
        )
    return team


def check_class(value: object, *, inherits: bool = True) -> str:
    """A priority class as given: ``interactive`` or ``batch``, or (``inherits``: a key's)
    ``""`` for its team's. Anything else is refused naming ``priority_class``: the one
    check of REST, the CLI and the keys page."""
    if isinstance(value, str) and (value in CLASSES or (inherits and value == "")):
        return value
    also = " (or empty: its team's)" if inherits else ""
    raise UserError(f"a priority class is interactive or batch{also}, not {value!r}",
                    field="priority_class")  # fmt: skip


@transaction.atomic
def add_user(
    username: str,
    *,
    password: str | None = None,
    staff: bool = False,
    limits: dict[str, Any] | None = None,
    actor: str = "",
) -> User:
    """Create a user, with ``limits`` for :func:`set_user_limits` if given (all or
    nothing). Without a password the account cannot log in until one is set."""
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
    if limits:
        set_user_limits(username, actor=actor, **limits)
    return user


def ceilings_of(user: User) -> Ceilings:
    return UserLimits.ceilings(UserLimits.objects.filter(user=user).first())


def _check_count(value: object, field: str, what: str) -> None:
    if value is not None and (not isinstance(value, int) or not 1 <= value <= MAX_RATE):
        raise UserError(f"{what} must be 1 to {MAX_RATE}", field=field)


def check_limits(
    requests_per_minute: object = None,
    max_concurrent: object = None,
    key_lifetime: object = None,
) -> None:
    """Refuse a limit no key or user can have (None: no limit), naming the field: the
    one check of REST, the CLI and the admin's forms."""
    _check_count(requests_per_minute, "requests_per_minute", "requests per minute")
    _check_count(max_concurrent, "max_concurrent", "concurrent requests")
    if key_lifetime is not None and not (
        isinstance(key_lifetime, timedelta) and timedelta(0) < key_lifetime <= MAX_LIFETIME
    ):
        raise UserError("a key lifetime must be more than 0 and at most 100 years",
                        field="key_lifetime")  # fmt: skip


def _narrow(
    value: int | None, ceiling: int | None, *, username: str, field: str, what: str
) -> int | None:
    """A key's count limit under its user's ceiling: none given takes the ceiling."""
    if ceiling is None:
        return value
    if value is None:
        return ceiling
    if value > ceiling:
        raise UserError(
            f"{username} may have at most {ceiling} {what}; a key cannot allow more",
            field=field,
        )
    return value


def model_named(name: str) -> Deployment | Adapter:
    """What ``name`` names in ``"model"``: a deployment (by its name or an alias) or an
    adapter, for allowlists (a key allowed an adapter is not thereby allowed its base)."""
    adapter = Adapter.objects.filter(name=name).first()
    return adapter if adapter is not None else get_deployment(name)


def set_models(owner: ApiKey | UserLimits, models: list[Deployment | Adapter] | None) -> None:
    """Write an allowlist: its deployments and its adapters, each in its own table."""
    owner.allowed_models.set([m for m in models or [] if isinstance(m, Deployment)])
    owner.allowed_adapters.set([m for m in models or [] if isinstance(m, Adapter)])


def _within_models(
    deployments: list[Deployment | Adapter], ceilings: Ceilings, username: str
) -> list[Deployment | Adapter] | None:
    """A key's models under its user's ceiling: none chosen means all the user may use,
    which is every model (None) or exactly the ceiling's."""
    if not deployments:
        if ceilings.models is None:
            return None
        named: list[Deployment | Adapter] = [
            *Deployment.objects.filter(name__in=ceilings.models),
            *Adapter.objects.filter(name__in=ceilings.models),
        ]
        return sorted(named, key=lambda m: m.name)
    if ceilings.models is None:
        return deployments
    outside = sorted(d.name for d in deployments if d.name not in ceilings.models)
    if outside:
        allowed = ", ".join(sorted(ceilings.models)) or "none"
        raise UserError(
            f"{username} may use only these models: {allowed}; not {', '.join(outside)}",
            field="models",
        )
    return deployments


def _within_lifetime(
    expires_at: datetime | None, ceilings: Ceilings, username: str, *, since: datetime
) -> datetime | None:
    """A key's expiry under its user's longest key lifetime (counted from ``since``)."""
    if ceilings.key_lifetime is None:
        return expires_at
    latest = since + ceilings.key_lifetime
    if expires_at is None:
        return latest
    if expires_at > latest + timedelta(seconds=1):  # a second's grace for the clock's tick
        raise UserError(
            f"{username}'s keys may live at most {span_text(ceilings.key_lifetime)}; "
            "choose an earlier expiry",
            field="expires",
        )
    return expires_at


def span_text(span: timedelta) -> str:
    """30d, 12h, 45m or 90s: the largest unit that divides it."""
    seconds = int(span.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def within_ceilings(
    user: User,
    deployments: list[Deployment | Adapter],
    requests_per_minute: int | None,
    max_concurrent: int | None,
    expires_at: datetime | None,
    *,
    since: datetime,
) -> tuple[list[Deployment | Adapter] | None, int | None, int | None, datetime | None]:
    """A key's models (None: every model), limits and expiry, narrowed to ``user``'s
    ceilings: a limit left out takes the ceiling, one beyond it raises a
    :class:`UserError` naming the field. ``since``: when the key was made (its lifetime
    counts from then)."""
    username = user.get_username()
    ceilings = ceilings_of(user)
    return (
        _within_models(deployments, ceilings, username),
        _narrow(requests_per_minute, ceilings.requests_per_minute, username=username,
                field="requests_per_minute", what="requests per minute"),
        _narrow(max_concurrent, ceilings.max_concurrent, username=username,
                field="max_concurrent", what="concurrent requests"),
        _within_lifetime(expires_at, ceilings, username, since=since),
    )  # fmt: skip


@transaction.atomic
def issue_api_key(
    username: str,
    *,
    name: str = "",
    models: list[str] | None = None,
    expires_in: timedelta | None = None,
    admin: bool = False,
    requests_per_minute: int | None = None,
    max_concurrent: int | None = None,
    team: str | None = None,
    priority_class: str = "",
    actor: str = "",
) -> tuple[ApiKey, str]:
    """Make a key for ``username``. Returns the row and the full key, which is shown once.

    The key's limits can only narrow its user's ceilings, whoever issues it: a limit left
    out takes the ceiling, one beyond it is refused. ``priority_class``: interactive or
    batch (empty: its team's, else interactive)."""
    check_class(priority_class)
    user = get_user(username)
    charged = team_for_key(user, team)
    deployments = [model_named(model) for model in models or []]
    if admin and not user.is_staff:
        raise UserError(
            f"user {username!r} is not staff, so their keys cannot have the admin scope",
            field="admin",
        )
    check_limits(requests_per_minute, max_concurrent)
    if len(name) > 100:
        raise UserError("a key name is at most 100 characters", field="name")
    now = timezone.now()
    scope, requests_per_minute, max_concurrent, expires_at = within_ceilings(
        user, deployments, requests_per_minute, max_concurrent,
        now + expires_in if expires_in else None, since=now,
    )  # fmt: skip
    key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(_KEY_ID_LENGTH))
    while ApiKey.objects.filter(key_id=key_id).exists():  # pragma: no cover - 36^10 space
        key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(_KEY_ID_LENGTH))
    secret = secrets.token_urlsafe(_SECRET_BYTES)
    key = ApiKey.objects.create(
        key_id=key_id,
        secret_hmac=hash_secret(secret),
        user=user,
        name=name,
        is_admin=admin,
        limit_models=scope is not None,
        requests_per_minute=requests_per_minute,
        max_concurrent=max_concurrent,
        expires_at=expires_at,
        team=charged,
        priority_class=priority_class,
    )
    set_models(key, scope)
    record_event(
        "key.created",
        f"API key {key.prefix} created for {username}"
        + (f" (models: {_names(scope)})" if scope is not None else "")
        + (f", charged to team {charged.name}" if charged is not None else "")
        + (f", class {priority_class}" if priority_class else ""),
        subject=key.prefix,
        actor=actor,
    )
    return key, f"{KEY_PREFIX}{key_id}_{secret}"


def _names(deployments: list[Deployment | Adapter]) -> str:
    return ", ".join(d.name for d in deployments) or "none"


def expires_at(key: ApiKey) -> datetime | None:
    """When ``key`` stops working by time: its own expiry or its user's longest key
    lifetime (counted from when it was made; one set later binds it too), the sooner."""
    limits: UserLimits | None = getattr(key.user, "limits", None)  # no row: no lifetime
    if limits is None or limits.key_lifetime is None:
        return key.expires_at
    ends = key.created_at + limits.key_lifetime
    return ends if key.expires_at is None else min(key.expires_at, ends)


def key_works(key: ApiKey, now: datetime | None = None) -> bool:
    """Whether ``key`` (its secret already checked) may be used at ``now``: not revoked,
    not expired, not past its user's key lifetime, its user active."""
    ends = expires_at(key)
    at = now or timezone.now()
    return key.revoked_at is None and key.user.is_active and (ends is None or at < ends)


def find_api_key(full_key: str, *, misses: RecentMisses | None = None) -> ApiKey | None:
    """The working key matching ``full_key``, or ``None`` (unknown, wrong secret, revoked,
    expired or its user inactive). With ``misses``, a key that failed is remembered there
    (by its id and secret, so no one's failure holds back the right secret) and not looked
    up again.

    An unknown id and a wrong secret cost the same: one HMAC and one compare, then (the
    first time) one read, so the time of the answer does not tell which ids exist."""
    parts = split_key(full_key)
    if parts is None:
        return None
    key_id, secret = parts
    digest = hash_secret(secret)
    failed = f"{key_id}:{digest}"
    if misses is not None and failed in misses:
        hmac.compare_digest(NO_KEY_HMAC, digest)  # the compare a lookup would make
        return None
    began = time.monotonic()
    key = ApiKey.objects.filter(key_id=key_id).select_related("user", "user__limits").first()
    matches = hmac.compare_digest(NO_KEY_HMAC if key is None else key.secret_hmac, digest)
    if key is None or not matches or not key_works(key):
        if misses is not None:
            misses.add(failed, began)
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
    max_concurrent: int | object | None = UNCHANGED,
    expires_at: datetime | object | None = UNCHANGED,
    team: str | object | None = UNCHANGED,
    priority_class: str | object = UNCHANGED,
    actor: str = "",
) -> ApiKey:
    """Change a key's label, allowed models (none: every model its user may use), limits,
    expiry, team (None: none) or priority class ("": its team's); its secret never
    changes. The new limits can only narrow its user's ceilings, as when it was made."""
    if priority_class is not UNCHANGED:
        check_class(priority_class)
    key = get_api_key(ident)
    username = key.user.get_username()
    ceilings = ceilings_of(key.user)
    changed = []
    if name is not None:
        if len(name) > 100:
            raise UserError("a key name is at most 100 characters", field="name")
        key.name = name
        changed.append("name")
    if requests_per_minute is not UNCHANGED:
        _check_count(requests_per_minute, "requests_per_minute", "requests per minute")
        key.requests_per_minute = _narrow(
            cast("int | None", requests_per_minute), ceilings.requests_per_minute,
            username=username, field="requests_per_minute", what="requests per minute",
        )  # fmt: skip
        changed.append("requests per minute")
    if max_concurrent is not UNCHANGED:
        _check_count(max_concurrent, "max_concurrent", "concurrent requests")
        key.max_concurrent = _narrow(
            cast("int | None", max_concurrent), ceilings.max_concurrent,
            username=username, field="max_concurrent", what="concurrent requests",
        )  # fmt: skip
        changed.append("concurrent requests")
    if expires_at is not UNCHANGED:
        if expires_at is not None and cast("datetime", expires_at) <= timezone.now():
            raise UserError("the expiry must be in the future", field="expires")
        key.expires_at = _within_lifetime(
            cast("datetime | None", expires_at), ceilings, username, since=key.created_at
        )
        changed.append("expiry")
    if team is not UNCHANGED:
        key.team = team_for_key(key.user, cast("str | None", team))
        changed.append(f"team {key.team.name}" if key.team is not None else "no team")
    if priority_class is not UNCHANGED:
        key.priority_class = cast("str", priority_class)
        changed.append(f"class {priority_class}" if priority_class else "its team's class")
    if models is not None:
        scope = _within_models([model_named(m) for m in models], ceilings, username)
        key.limit_models = scope is not None
        set_models(key, scope)
        changed.append(f"models {_names(scope)}" if scope is not None else "all models")
    key.save()
    record_event(
        "key.changed",
        f"API key {key.prefix} changed: {', '.join(changed) or 'nothing'}",
        subject=key.prefix,
        actor=actor,
    )
    return key


@transaction.atomic
def set_user_limits(
    username: str,
    *,
    models: list[str] | object | None = UNCHANGED,
    requests_per_minute: int | object | None = UNCHANGED,
    max_concurrent: int | object | None = UNCHANGED,
    key_lifetime: timedelta | object | None = UNCHANGED,
    actor: str = "",
) -> UserLimits:
    """Set a user's ceilings (None: no ceiling; ``models`` None: every model). Their
    existing keys are narrowed at request time; new keys are checked when made."""
    user = get_user(username)
    check_limits(*(None if value is UNCHANGED else value
                   for value in (requests_per_minute, max_concurrent, key_lifetime)))  # fmt: skip
    deployments = None
    if models is not UNCHANGED and models is not None:
        deployments = [model_named(m) for m in cast("list[str]", models)]
    limits, _ = UserLimits.objects.select_for_update().get_or_create(user=user)
    changed = []
    if models is not UNCHANGED:
        limits.models_limited = deployments is not None
        changed.append("models")
    if requests_per_minute is not UNCHANGED:
        limits.requests_per_minute = cast("int | None", requests_per_minute)
        changed.append("requests per minute")
    if max_concurrent is not UNCHANGED:
        limits.max_concurrent = cast("int | None", max_concurrent)
        changed.append("concurrent requests")
    if key_lifetime is not UNCHANGED:
        limits.key_lifetime = cast("timedelta | None", key_lifetime)
        changed.append("key lifetime")
    limits.save()
    if models is not UNCHANGED:
        set_models(limits, deployments)
    record_event(
        "user.limits",
        f"user {username} limits changed: {', '.join(changed) or 'nothing'}",
        subject=username,
        actor=actor,
    )
    return limits


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
