from django.apps import AppConfig


class WebConfig(AppConfig):
    name = "capyctl.web"
    verbose_name = "Web"
