from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from capyctl.access.models import ApiKey
from capyctl.access.services import revoke_api_key


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "prefix",
        "name",
        "user",
        "is_admin",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "request_count",
    )
    list_filter = ("is_admin", "user")
    search_fields = ("key_id", "name", "user__username")
    readonly_fields = (
        "key_id",
        "user",
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
        "is_admin",
        "requests_per_minute",
        "expires_at",
        *readonly_fields,
    )
    filter_horizontal = ("allowed_models",)
    actions = ("revoke_keys",)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A key's secret is shown once at creation: `capyctl key create` does that.
        return False

    @admin.action(description="Revoke the selected keys")
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for key in queryset:
            revoke_api_key(key.key_id, actor=request.user.get_username())
        self.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)
