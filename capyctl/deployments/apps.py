from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "capyctl.deployments"
    verbose_name = "Deployments"
