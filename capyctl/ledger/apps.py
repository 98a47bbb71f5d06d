from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "capyctl.ledger"
    verbose_name = "Memory ledger"
