"""Who may use the REST API.

Automation authenticates with an API key that has the admin scope (``Authorization:
Bearer capy_…``); people use their logged-in session (with its CSRF token). Staff may do
everything; any other user only manages their own API keys. A key without the admin
scope is for ``/v1`` only: it could otherwise mint itself wider keys.

Guessed keys cost the guesser, as on ``/v1`` (with the same memory,
:mod:`capyctl.access.guessing`): a key not of the shape this server makes is refused
before any lookup, a key that failed is remembered as failed for a few seconds (by its
id and secret), and an address whose checks keep failing is answered 429 for each
failure. A real key is let in from that address too: the throttle slows guessing, not
use, so every well-formed key is looked up (one indexed read, the cost of any request
with a session cookie). An unknown id and a wrong secret cost the same work.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from capyctl.access.guessing import FailureThrottle, RecentMisses, request_address
from capyctl.access.models import ApiKey
from capyctl.access.services import KEY_PREFIX, find_api_key

_misses = RecentMisses()
_failures = FailureThrottle()


def reset_guards() -> None:
    """Forget the failed keys and failing addresses seen so far."""
    _misses.clear()
    _failures.clear()


class ApiKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer capy_<id>_<secret>`` (or ``X-Api-Key``)."""

    def authenticate(self, request: Request) -> tuple[AbstractBaseUser, ApiKey] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            token = request.META.get("HTTP_X_API_KEY", "")
        token = token.strip()
        if not token:
            return None
        if not token.startswith(KEY_PREFIX):
            raise exceptions.AuthenticationFailed("the bearer token is not a CapyCTL API key")
        key = find_api_key(token, misses=_misses)
        if key is not None:
            return key.user, key  # throttled or not: the throttle slows guessing, not use
        address = request_address(request.META)
        wait = _failures.wait(address)
        if wait:
            raise exceptions.Throttled(
                wait, detail="Too many requests with invalid API keys from this address."
            )
        _failures.failed(address)
        raise exceptions.AuthenticationFailed("invalid, revoked or expired API key")

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="capyctl"'


class ApiKeyScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "capyctl.api.auth.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "an API key with admin scope"}


def is_admin(request: Request) -> bool:
    """Staff session, or a key with the admin scope whose user is still staff."""
    user = request.user
    if isinstance(user, AnonymousUser) or not user.is_authenticated or not user.is_active:
        return False
    if isinstance(request.auth, ApiKey):
        return bool(request.auth.is_admin and user.is_staff)
    return bool(user.is_staff)


def _no_user_keys(request: Request) -> None:
    if isinstance(request.auth, ApiKey) and not request.auth.is_admin:
        raise exceptions.PermissionDenied(
            "this API key has no admin scope; the REST API takes an admin key or a "
            "logged-in session"
        )


class IsAdmin(BasePermission):
    """Staff session or admin key."""

    def has_permission(self, request: Request, view: Any) -> bool:
        _no_user_keys(request)
        return is_admin(request)


class IsSignedIn(BasePermission):
    """Any logged-in user (their own keys), or an admin key."""

    def has_permission(self, request: Request, view: Any) -> bool:
        _no_user_keys(request)
        return bool(request.user and request.user.is_authenticated and request.user.is_active)
