"""Helpers shared by the apps' admin modules."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from capyctl.errors import UserError


def attach_user_error(form: forms.BaseForm, error: UserError) -> None:
    """Show a service-layer error on the form field it names (or on the whole form)."""
    field = error.field if error.field in form.fields else None
    form.add_error(field, error.message)


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows only the scheduler writes: visible, filterable, never edited by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
