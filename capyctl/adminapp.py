"""The admin app, its ModelAdmins found when they are needed rather than at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.contrib import admin
from django.contrib.admin.apps import SimpleAdminConfig
from django.contrib.admin.checks import check_admin_app, check_dependencies
from django.core import checks


class AdminConfig(SimpleAdminConfig):
    """``django.contrib.admin`` without discovering the admin modules in ``ready()``.

    Importing every ``admin.py`` (and the services they use) cost each ``capyctl``
    command; ``capyctl.urls`` discovers them before it routes ``/admin/``, and the admin's
    checks do before checking them.
    """

    def ready(self) -> None:
        checks.register(check_dependencies, checks.Tags.admin)
        checks.register(check_discovered_admin, checks.Tags.admin)


def check_discovered_admin(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Django's checks of every registered ModelAdmin, once all are registered."""
    admin.autodiscover()
    return check_admin_app(app_configs, **kwargs)
