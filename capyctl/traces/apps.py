from django.apps import AppConfig


class TracesConfig(AppConfig):
    name = "capyctl.traces"
    verbose_name = "Request traces"
