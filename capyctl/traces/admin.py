from django.contrib import admin

from capyctl.admin_utils import ReadOnlyAdmin
from capyctl.traces.models import RequestTrace


@admin.register(RequestTrace)
class RequestTraceAdmin(ReadOnlyAdmin):
    list_display = ("at", "model", "key_pk", "stream", "status", "code", "queued_ms",
                    "ttfb_ms", "duration_ms", "prompt_tokens", "completion_tokens")  # fmt: skip
    list_filter = ("stream",)  # a filter on model or status would scan every row for choices
    search_fields = ("model",)
    date_hierarchy = "at"
    ordering = ("-at",)  # the newest first, as an operator looks for them
    show_full_result_count = False  # no second COUNT(*) over up to a million rows
