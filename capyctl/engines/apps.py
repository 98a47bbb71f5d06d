from django.apps import AppConfig


class EnginesConfig(AppConfig):
    name = "capyctl.engines"
    verbose_name = "Engines"
