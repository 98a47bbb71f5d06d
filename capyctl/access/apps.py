from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "capyctl.access"
    verbose_name = "Access"
