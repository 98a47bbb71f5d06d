from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin

from capyctl.admin_utils import attach_user_error
from capyctl.engines.models import Engine
from capyctl.engines.services import check_engine
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
    list_display = ("name", "kind", "command", "host")
    list_filter = ("kind", "host")
    search_fields = ("name", "command")
