"""Host registration and the local host's inventory."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from capyctl.errors import NotFoundError
from capyctl.events.services import record_event
from capyctl.hosts.models import LOCAL_HOST_NAME, Host
from hostagent.probe import Inventory
from hostagent.units import format_size


def get_host(name: str) -> Host:
    try:
        return Host.objects.get(name=name)
    except Host.DoesNotExist:
        raise NotFoundError(f"no host named {name!r}", field="host") from None


@transaction.atomic
def ensure_local_host(inventory: Inventory) -> Host:
    """Create or refresh the in-process host ``local`` with what the probe sees now."""
    host, created = Host.objects.get_or_create(
        name=LOCAL_HOST_NAME, defaults={"is_local": True, "state": Host.State.ONLINE}
    )
    host.is_local = True
    host.state = Host.State.ONLINE
    host.inventory = inventory.as_dict()
    host.last_seen_at = timezone.now()
    host.save()
    if created:
        gpus = ", ".join(f"{g.name} ({format_size(g.total_bytes)})" for g in inventory.gpus)
        record_event(
            "host.added",
            f"local host registered: {gpus or 'no GPUs'}, probe {inventory.probe}",
            subject=host.name,
            host_id=host.pk,
            actor="system",
        )
    return host
