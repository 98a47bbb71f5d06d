"""``/keys/``: any logged-in user creates, lists and revokes their own API keys.

A new key's full text is shown in the answer to the form that made it, and never again;
no answer of this page may be stored by any cache (``Cache-Control: no-store``).
The page offers only what the user's ceilings allow; the service checks it again (a
forged form is refused with the same message as REST and the CLI give).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from capyctl.access.models import ApiKey
from capyctl.access.services import ceilings_of, issue_api_key, revoke_api_key, span_text
from capyctl.deployments.models import Adapter, Deployment
from capyctl.errors import UserError
from capyctl.validation import parse_duration

EXPIRY_CHOICES = [("", "never"), ("1d", "1 day"), ("7d", "7 days"), ("30d", "30 days"),
                  ("90d", "90 days"), ("365d", "1 year")]  # fmt: skip


def _page(request: HttpRequest, **extra: Any) -> HttpResponse:
    keys = (
        ApiKey.objects.filter(user_id=request.user.pk or 0)
        .select_related("team")
        .prefetch_related("allowed_models", "allowed_adapters")
        .order_by("revoked_at", "-created_at")
    )
    ceilings = ceilings_of(request.user)  # type: ignore[arg-type]
    models = sorted(
        [
            # a key names models (adapters too), not replicas
            *Deployment.objects.filter(replica_of__isnull=True).values_list("name", flat=True),
            *Adapter.objects.values_list("name", flat=True),
        ]
    )
    expiry_choices = EXPIRY_CHOICES
    if ceilings.models is not None:
        models = [m for m in models if m in ceilings.models]
    if ceilings.key_lifetime is not None:
        longest = ceilings.key_lifetime
        expiry_choices = [
            (value, label)
            for value, label in EXPIRY_CHOICES
            if value and parse_duration(value, field="expires") <= longest
        ]
    context = {
        "nav": "keys",
        "keys": keys,
        "models": models,
        "expiry_choices": expiry_choices,
        # the teams a key of theirs may be charged to
        "teams": list(request.user.teams.values_list("name", flat=True)),  # type: ignore[union-attr]
        "ceilings": ceilings,
        "lifetime": span_text(ceilings.key_lifetime) if ceilings.key_lifetime else None,
        **extra,
    }
    return render(request, "web/keys.html", context, status=400 if "error" in extra else 200)


@never_cache
@login_required
@require_http_methods(["GET", "POST"])
def keys_page(request: HttpRequest) -> HttpResponse:
    """The list, and (POST) a new key for the logged-in user."""
    if request.method == "GET":
        return _page(request)
    name = request.POST.get("name", "").strip()
    models = [m for m in request.POST.getlist("models") if m]
    expires = request.POST.get("expires", "")
    if expires not in {value for value, _ in EXPIRY_CHOICES}:
        return _page(request, error=f"unknown expiry {expires!r}", form_name=name)
    try:
        key, full = issue_api_key(
            request.user.get_username(),
            name=name,
            models=models,
            expires_in=parse_duration(expires, field="expires") if expires else None,
            requests_per_minute=_count(request, "requests_per_minute"),
            max_concurrent=_count(request, "max_concurrent"),
            team=request.POST.get("team", "").strip() or None,
            priority_class=request.POST.get("priority_class", "").strip(),
            actor=request.user.get_username(),
        )
    except UserError as exc:
        return _page(request, error=exc.message, form_name=name)
    return _page(request, new_key=full, new_prefix=key.prefix)


def _count(request: HttpRequest, field: str) -> int | None:
    """An optional whole number from the form (blank: none)."""
    text = request.POST.get(field, "").strip()
    if not text:
        return None
    if not text.isdigit() or len(text) > 10:
        raise UserError(f"{field.replace('_', ' ')} must be a whole number", field=field)
    return int(text)


@never_cache
@login_required
@require_POST
def revoke_key(request: HttpRequest, key_id: str) -> HttpResponse:
    """Revoke one of the user's own keys (another user's reads as not found)."""
    if not ApiKey.objects.filter(user_id=request.user.pk or 0, key_id=key_id).exists():
        return _page(request, error=f"you have no API key with id {key_id!r}")
    revoke_api_key(key_id, actor=request.user.get_username())
    return redirect("keys")
