from django.apps import AppConfig


class HostsConfig(AppConfig):
    name = "capyctl.hosts"
    verbose_name = "Hosts"
