"""API keys in the admin: made through the same service as the CLI, the full key shown
once on the page that answers the form (never stored, never put in a message cookie)."""

from __future__ import annotations

from typing import Any, ClassVar

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from capyctl.access import budgets, teams
from capyctl.access.models import ApiKey, Budget, Team, Usage, UserLimits
from capyctl.access.services import (
    check_limits,
    issue_api_key,
    revoke_api_key,
    set_user_limits,
    team_for_key,
    update_api_key,
    within_ceilings,
)
from capyctl.errors import UserError
from capyctl.events.services import record_event


def _check_on_fields(form: forms.ModelForm, check: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[type-arg]
    """Run a service check, its :class:`UserError` shown on the form's field at fault, so
    the form comes back with the message instead of the save failing."""
    try:
        check(*args, **kwargs)
    except UserError as exc:
        field = {"models": "allowed_models", "expires": "expires_at"}.get(
            exc.field or "", exc.field
        )
        form.add_error(field if field in form.fields else None, exc.message)


def _chosen(data: dict[str, Any]) -> list[Any]:
    """The deployments and adapters a form's allowlist chose."""
    return [*(data.get("allowed_models") or []), *(data.get("allowed_adapters") or [])]


class NewKeyForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = ApiKey
        fields = ("user", "name", "allowed_models", "allowed_adapters", "team", "priority_class",
                  "is_admin", "requests_per_minute", "max_concurrent", "expires_at")  # fmt: skip
        help_texts: ClassVar = {
            "allowed_models": "none chosen here or below: every model its user may use",
            "allowed_adapters": "adapters it may use: one does not allow its base",
        }

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        _check_on_fields(self, check_limits, data.get("requests_per_minute"),
                         data.get("max_concurrent"))  # fmt: skip
        expires = data.get("expires_at")
        if expires is not None and expires <= timezone.now():
            self.add_error("expires_at", "the expiry must be in the future")
        owner = data.get("user") or (self.instance.user if self.instance.pk else None)
        if data.get("is_admin") and owner is not None and not owner.is_staff:
            self.add_error(
                "is_admin",
                f"user {owner.username!r} is not staff, so their keys cannot have the admin scope",
            )
        team = data.get("team")
        if owner is not None and team is not None:
            _check_on_fields(self, team_for_key, owner, team.name)
        if owner is not None and not self.errors:
            # The same ceilings as the service applies, shown on the field at fault.
            made = self.instance.created_at if self.instance.pk else timezone.now()
            _check_on_fields(
                self, within_ceilings, owner, _chosen(data),
                data.get("requests_per_minute"), data.get("max_concurrent"),
                expires, since=made,
            )  # fmt: skip
        return data


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "prefix",
        "name",
        "user",
        "team",
        "priority",
        "is_admin",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "request_count",
    )
    list_select_related = ("user", "team")
    list_filter = ("is_admin", "priority_class", "user")
    search_fields = ("key_id", "name", "user__username")
    readonly_fields = (
        "key_id",
        "user",
        "limit_models",
        "revoked_at",
        "last_used_at",
        "request_count",
        "prompt_tokens",
        "completion_tokens",
        "created_at",
    )
    fields = (
        "name",
        "allowed_models",
        "allowed_adapters",
        "team",
        "priority_class",
        "is_admin",
        "requests_per_minute",
        "max_concurrent",
        "expires_at",
        *readonly_fields,
    )
    filter_horizontal = ("allowed_models", "allowed_adapters")
    actions = ("revoke_keys",)

    @admin.display(description="class", ordering="priority_class")
    def priority(self, key: ApiKey) -> str:
        """Its class: its own, or its team's (``batch (team)``), else interactive."""
        if key.priority_class or key.team_id is None:
            return key.effective_class
        return f"{key.effective_class} (team)"

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        kwargs["form"] = NewKeyForm
        editable = self.fields[: -len(self.readonly_fields)]
        kwargs["fields"] = NewKeyForm.Meta.fields if obj is None else editable
        return super().get_form(request, obj, change, **kwargs)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return NewKeyForm.Meta.fields if obj is None else self.fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return () if obj is None else self.readonly_fields

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        actor = request.user.get_username()
        data = form.cleaned_data
        models = [m.name for m in _chosen(data)]
        changed = {"allowed_models", "allowed_adapters"} & set(form.changed_data)
        if change:
            update_api_key(
                obj.key_id, name=data.get("name", ""),
                # Untouched, a limited key whose models were all removed stays limited to
                # none (an empty choice would otherwise read as every model).
                models=models if changed else None,
                requests_per_minute=data.get("requests_per_minute"),
                max_concurrent=data.get("max_concurrent"),
                expires_at=data.get("expires_at"), actor=actor,
                team=data["team"].name if data.get("team") else None,
                priority_class=data.get("priority_class") or "",
            )  # fmt: skip
            ApiKey.objects.filter(pk=obj.pk).update(is_admin=bool(data.get("is_admin")))
            return
        expires = data.get("expires_at")
        key, full = issue_api_key(
            data["user"].username,
            name=data.get("name", ""),
            models=models,
            expires_in=(expires - timezone.now()) if expires else None,
            admin=bool(data.get("is_admin")),
            requests_per_minute=data.get("requests_per_minute"),
            max_concurrent=data.get("max_concurrent"),
            team=data["team"].name if data.get("team") else None,
            priority_class=data.get("priority_class") or "",
            actor=actor,
        )
        obj.pk = key.pk
        obj.key_id = key.key_id
        request._capyctl_new_key = full  # type: ignore[attr-defined]

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """The service set the allowed models already."""

    def response_add(
        self, request: HttpRequest, obj: ApiKey, post_url_continue: Any = None
    ) -> HttpResponse:
        full = getattr(request, "_capyctl_new_key", None)
        if full is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "title": f"API key {obj.prefix} created",
            "key": ApiKey.objects.get(pk=obj.pk),
            "full_key": full,
            "opts": self.opts,
        }
        return TemplateResponse(request, "admin/access/apikey/created.html", context)

    @admin.action(description="Revoke the selected keys")
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for key in queryset:
            revoke_api_key(key.key_id, actor=request.user.get_username())
        self.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)


class UserLimitsForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = UserLimits
        fields = ("user", "models_limited", "allowed_models", "allowed_adapters",
                  "requests_per_minute", "max_concurrent", "key_lifetime")  # fmt: skip

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        _check_on_fields(self, check_limits, data.get("requests_per_minute"),
                         data.get("max_concurrent"), data.get("key_lifetime"))  # fmt: skip
        return data


@admin.register(UserLimits)
class UserLimitsAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A user's ceilings, saved through the same service as REST and ``capyctl user``,
    checked by it first so a bad value comes back on its field."""

    form = UserLimitsForm

    list_display = ("user", "models_limited", "requests_per_minute", "max_concurrent",
                    "key_lifetime")  # fmt: skip
    search_fields = ("user__username",)
    fields = ("user", "models_limited", "allowed_models", "allowed_adapters",
              "requests_per_minute", "max_concurrent", "key_lifetime")  # fmt: skip
    filter_horizontal = ("allowed_models", "allowed_adapters")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return () if obj is None else ("user",)

    def save_model(self, request: HttpRequest, obj: UserLimits, form: Any, change: bool) -> None:
        data = form.cleaned_data
        limits = set_user_limits(
            obj.user.get_username(),
            models=[m.name for m in _chosen(data)] if data.get("models_limited") else None,
            requests_per_minute=data.get("requests_per_minute"),
            max_concurrent=data.get("max_concurrent"),
            key_lifetime=data.get("key_lifetime"),
            actor=request.user.get_username(),
        )
        obj.pk = limits.pk

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """The service set the allowed models already."""


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Teams: added and their members chosen here or with ``capyctl team``; one is removed
    only once no key is charged to it, a member only once none of theirs is."""

    list_display = ("name", "priority_class", "created_at")
    list_filter = ("priority_class",)
    search_fields = ("name", "members__username")
    fields = ("name", "priority_class", "members")
    filter_horizontal = ("members",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ("name",) if obj else ()

    def save_model(self, request: HttpRequest, obj: Team, form: Any, change: bool) -> None:
        actor = request.user.get_username()
        chosen = form.cleaned_data["priority_class"]
        if not change:
            saved = teams.add_team(form.cleaned_data["name"], priority_class=chosen, actor=actor)
            obj.pk = saved.pk
            obj.refresh_from_db()
        elif "priority_class" in form.changed_data:
            teams.update_team(obj.name, priority_class=chosen, actor=actor)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        """Members through the service: one whose keys are charged here stays, and says so."""
        team = form.instance
        actor = request.user.get_username()
        wanted = {u.username for u in form.cleaned_data.get("members") or []}
        now = set(team.members.values_list("username", flat=True))
        for username in sorted(wanted - now):
            teams.add_member(team.name, username, actor=actor)
        for username in sorted(now - wanted):
            try:
                teams.remove_member(team.name, username, actor=actor)
            except UserError as exc:
                self.message_user(request, str(exc), messages.ERROR)

    def delete_model(self, request: HttpRequest, obj: Team) -> None:
        teams.remove_team(obj.name, actor=request.user.get_username())

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Team]) -> None:
        for team in queryset:
            try:
                teams.remove_team(team.name, actor=request.user.get_username())
            except UserError as exc:
                self.message_user(request, str(exc), messages.ERROR)


class BudgetForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = Budget
        fields = ("key", "user", "team", "tokens", "gpu_seconds", "spend", "period", "soft_percent")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        try:
            budgets.check_budget(
                scopes=sum(data.get(f) is not None for f in ("key", "user", "team")),
                tokens=data.get("tokens"), gpu_seconds=data.get("gpu_seconds"),
                period=str(data.get("period") or ""), soft_percent=data.get("soft_percent"),
                spend=data.get("spend"),
            )  # fmt: skip
        except UserError as exc:
            raise forms.ValidationError(str(exc)) from None
        same = Budget.objects.filter(period=data.get("period"), key=data.get("key"),
                                     user=data.get("user"), team=data.get("team"))  # fmt: skip
        if self.instance.pk is not None:
            same = same.exclude(pk=self.instance.pk)
        if same.exists():
            raise forms.ValidationError("this key, user or team has a budget for that period")
        return data


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Budgets: set here or with ``capyctl budget set``; what each period used so far is
    shown, summed from the usage record."""

    form = BudgetForm
    list_display = (
        "id",
        "whose",
        "period",
        "tokens",
        "gpu_seconds",
        "spend",
        "soft_percent",
        "used",
    )
    list_filter = ("period",)
    raw_id_fields = ("key",)

    @admin.display(description="of")
    def whose(self, obj: Budget) -> str:
        return budgets.whose(obj)

    @admin.display(description="used this period")
    def used(self, obj: Budget) -> str:
        row = budgets.budget_row(obj)
        return (
            f"{row['used_tokens']:,} tokens, {row['used_gpu_seconds']:,} GPU-s, "
            f"{row['used_spend']:,.2f} spent"
        )

    def save_model(self, request: HttpRequest, obj: Budget, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        record_event("budget.set", f"{budgets.describe(obj)}: {budgets.limits_text(obj)}",
                     subject=budgets.whose(obj), actor=request.user.get_username())  # fmt: skip


@admin.register(Usage)
class UsageAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The usage record, read only: written by the gateway."""

    list_display = ("at", "key", "team", "model", "requests", "prompt_tokens",
                    "completion_tokens", "gpu_seconds", "switch_gpu_seconds")  # fmt: skip
    list_filter = ("team", "model")
    date_hierarchy = "at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
