"""The Celery application. Server mode uses Redis as broker; standalone runs tasks eagerly
in-process (``CELERY_TASK_ALWAYS_EAGER``), so the same task code serves both."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")

app = Celery("capyctl")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
