"""Logging in, with failed tries throttled per user name and client address.

After ``LOGIN_MAX_FAILURES`` failed tries for one user name from one address, that pair
is locked out for ``LOGIN_LOCKOUT_SECONDS``: even the right password is refused, so
guessing stops paying. The same user from an address that has not failed is never
locked out. The address is the client's own behind a trusted proxy (``TRUSTED_PROXIES``)
and counts IPv6 by its /64, which one client usually holds whole. The counters live in
Django's cache (in-process memory: one web process serves logins in standalone and in
server mode). The login page and the admin's say so in words, and the login page
answers 429.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import views as auth_views
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.models import User
from django.core.cache import cache
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse

from capyctl.access.guessing import request_address


def _slot(request: HttpRequest | None, username: str | None) -> str:
    address = request_address(request.META) if request is not None else ""
    # Hashed: any user name fits a cache key, and none is kept in clear.
    digest = hashlib.sha256(f"{(username or '').lower()}\0{address}".encode()).hexdigest()
    return f"capyctl:login-failures:{digest}"


def locked_out(request: HttpRequest | None, username: str | None) -> bool:
    return int(cache.get(_slot(request, username), 0)) >= settings.LOGIN_MAX_FAILURES


def _failed(request: HttpRequest | None, username: str | None) -> None:
    slot = _slot(request, username)
    # The lockout runs from the last failure: add() starts the window, incr() counts in it.
    if not cache.add(slot, 1, timeout=settings.LOGIN_LOCKOUT_SECONDS):
        try:
            count = cache.incr(slot)
        except ValueError:  # expired between add() and incr()
            cache.add(slot, 1, timeout=settings.LOGIN_LOCKOUT_SECONDS)
        else:
            cache.set(slot, count, timeout=settings.LOGIN_LOCKOUT_SECONDS)


class ThrottledModelBackend(ModelBackend):
    """Django's user and password check, refused while the pair is locked out."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> User | None:
        if locked_out(request, username):
            raise PermissionDenied("too many failed logins")  # no other backend is asked
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            _failed(request, username)
        else:
            cache.delete(_slot(request, username))
        return user


def _lockout_error(form: AuthenticationForm) -> ValidationError | None:
    if not locked_out(form.request, form.data.get("username")):
        return None
    minutes = max(1, round(settings.LOGIN_LOCKOUT_SECONDS / 60))
    return ValidationError(
        f"Too many failed logins for this user from your address: try again in "
        f"{minutes} minute{'s' if minutes != 1 else ''}.",
        code="locked_out",
    )


class ThrottledLoginForm(AuthenticationForm):
    def get_invalid_login_error(self) -> ValidationError:
        return _lockout_error(self) or super().get_invalid_login_error()


class ThrottledAdminLoginForm(AdminAuthenticationForm):
    def get_invalid_login_error(self) -> ValidationError:
        return _lockout_error(self) or super().get_invalid_login_error()


class LoginView(auth_views.LoginView):
    """``/login/``: Django's page; a locked-out try is answered 429."""

    authentication_form = ThrottledLoginForm

    def form_invalid(self, form: AuthenticationForm) -> HttpResponse:
        response = super().form_invalid(form)
        if form.has_error("__all__", code="locked_out"):
            response.status_code = 429
        return response
