"""The Celery application. Server mode uses Redis as broker; standalone runs tasks eagerly
in-process (``CELERY_TASK_ALWAYS_EAGER``), so the same task code serves both."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP
from kombu import Connection

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")

# When Redis comes back after an outage, a worker reconnects within a second: kombu's own
# schedule waits 2 s, then 4, 6… up to 30 s between tries, so a worker could sit idle for
# half a minute after the broker returned while requests wait for a switch.
RECONNECT_EVERY_SECONDS = 0.5


class _PromptConnection(Connection):
    def ensure_connection(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("interval_start", RECONNECT_EVERY_SECONDS)
        kwargs.setdefault("interval_step", 0)
        kwargs.setdefault("interval_max", RECONNECT_EVERY_SECONDS)
        return super().ensure_connection(*args, **kwargs)


class _PromptAMQP(AMQP):
    Connection = _PromptConnection


app = Celery("capyctl", amqp=_PromptAMQP)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
