"""Outcomes of wakes, told over the Channels layer to whoever waits for them.

In server mode a wake runs on a Celery worker while the request that asked for it waits in
an API process: the worker sends the outcome to the deployment's group, and the gateway,
listening on that group, answers at once (re-reading the database meanwhile, in case a
message is lost). Standalone needs none of this: the waiter awaits the wake itself.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger("capyctl.scheduler")


def group(deployment_id: int) -> str:
    return f"capyctl-deployment-{deployment_id}"


def announce(deployment_id: int, **outcome: Any) -> None:
    """Send ``outcome`` (``ok``, and ``code``/``message`` when it failed) to the waiters."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            group(deployment_id), {"type": "deployment.outcome", **outcome}
        )
    except Exception as exc:  # waiters fall back on the database; say why once here
        from capyctl.deployments.models import Deployment  # noqa: PLC0415 - a failure's words only

        name = Deployment.objects.filter(pk=deployment_id).values_list("name", flat=True).first()
        logger.warning("could not announce the outcome for %s: %s", name or deployment_id, exc)
