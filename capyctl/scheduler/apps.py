from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "capyctl.scheduler"
    verbose_name = "Scheduler"

    def ready(self) -> None:
        # Make CapyCTL's Celery app the current one, so tasks run eagerly in standalone and
        # go to the configured broker in server mode, never to a library default.
        from capyctl import celery  # noqa: F401
