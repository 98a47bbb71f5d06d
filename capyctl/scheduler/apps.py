from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "capyctl.scheduler"
    verbose_name = "Scheduler"
