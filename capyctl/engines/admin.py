from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from capyctl.admin_utils import attach_user_error
from capyctl.engines.models import Engine
from capyctl.engines.services import add_engine, check_engine, update_engine
from capyctl.errors import UserError


class EngineForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = Engine
        fields = ("name", "kind", "command", "host", "env", "options")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if not self.errors:
            try:
                check_engine(data["name"], data["kind"], data["command"], data.get("options"))
            except UserError as exc:
                attach_user_error(self, exc)
        return data


@admin.register(Engine)
class EngineAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    form = EngineForm
    list_display = ("name", "kind", "version", "command", "host")
    list_filter = ("kind", "host")
    search_fields = ("name", "command")
    readonly_fields = ("version", "version_note", "flags", "version_checked_at")

    def save_model(self, request: HttpRequest, obj: Engine, form: EngineForm, change: bool) -> None:
        """Saved by the same service as the CLI and REST (it records the event)."""
        data, actor = form.cleaned_data, request.user.get_username()
        host = data["host"].name if data.get("host") else None
        if change:
            original = Engine.objects.get(pk=obj.pk)
            saved = update_engine(
                original.name, new_name=data["name"], kind=data["kind"], command=data["command"],
                host=host, clear_host=host is None, env=data.get("env") or {},
                options=data.get("options") or {}, actor=actor,
            )  # fmt: skip
        else:
            saved = add_engine(
                data["name"], kind=data["kind"], command=data["command"], host=host,
                env=data.get("env") or {}, options=data.get("options") or {}, actor=actor,
            )  # fmt: skip
        obj.pk = saved.pk
        obj.refresh_from_db()
