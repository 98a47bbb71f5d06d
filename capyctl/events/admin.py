from django.contrib import admin

from capyctl.admin_utils import ReadOnlyAdmin
from capyctl.events.models import Event


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "kind", "level", "subject", "message", "duration_ms", "actor")
    list_filter = ("level", "kind", "host")
    search_fields = ("subject", "message")
    date_hierarchy = "created_at"
