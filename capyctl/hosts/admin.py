from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from capyctl.hosts.models import Host


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "address", "state", "is_local", "last_seen_at")
    list_filter = ("state", "is_local")
    search_fields = ("name", "address")
    readonly_fields = ("is_local", "state", "inventory", "last_seen_at", "created_at", "updated_at")
    fields = ("name", "address", "gpu_reserve_bytes", "ram_reserve_bytes", *readonly_fields)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Hosts join with `capyctl host add` and a join token; the local one registers itself.
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
