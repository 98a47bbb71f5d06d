from django.apps import AppConfig


class EventsConfig(AppConfig):
    name = "capyctl.events"
    verbose_name = "Events"
