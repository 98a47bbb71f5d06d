from django.contrib import admin

from capyctl.admin_utils import ReadOnlyAdmin
from capyctl.ledger.models import LedgerEntry


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = ("host", "pool", "deployment", "status", "bytes", "updated_at")
    list_filter = ("host", "pool", "status")
