"""A host's changes that move its state, asked for by people or by the start-up: the local
host seen by the probe, a remote host's certificate revoked, a host removed. Each checks
what is asked and lets :mod:`capyctl.scheduler.transitions` write the state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from capyctl.errors import UserError
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.hosts.services import get_host
from capyctl.scheduler import transitions
from hostagent.units import format_size

if TYPE_CHECKING:
    from hostagent.probe import Inventory


@transaction.atomic
def ensure_local_host(inventory: Inventory) -> Host:
    """Create or refresh the in-process host ``local`` with what the probe sees now."""
    host, created = transitions.local_host_seen(inventory.as_dict())
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


def revoke_host(name: str, *, actor: str = "") -> Host:
    """Stop trusting a host's certificate at once: every call to its agent is refused
    (the pin is cleared), so are its pending join tokens; it shows unreachable and what
    its models hold stays counted as unconfirmed. It comes back by joining again with a
    new token (``capyctl host token NAME``)."""
    from capyctl.scheduler.remote_hosts import mark_unreachable  # noqa: PLC0415 - httpx and certificates kept off the listings' start-up

    host = get_host(name)
    if host.is_local:
        raise UserError(f"{name!r} is the in-process host; it has no certificate", field="name")
    if not host.cert_fingerprint:
        raise UserError(f"host {name} has no certificate to revoke", field="name")
    with transaction.atomic():
        Host.objects.filter(pk=host.pk).update(
            cert_fingerprint="", cert_expires_at=None, join_secret_hmac="", join_expires_at=None
        )
        record_event(
            "host.revoked",
            f"host {name}: certificate {host.cert_fingerprint[:16]}… revoked; it must join "
            f"again (capyctl host token {name})",
            subject=name,
            host_id=host.pk,
            actor=actor,
            level="warning",
        )
        mark_unreachable(host, f"host {name}: its certificate was revoked")
    host.refresh_from_db()
    return host


def remove_host(name: str) -> None:
    """Forget a host: refused while engines or deployments are placed on it."""
    host = get_host(name)
    if host.is_local:
        raise UserError(f"{name!r} is the in-process host; it cannot be removed", field="name")
    engines = list(host.engines.values_list("name", flat=True))
    deployments = list(host.deployments.values_list("name", flat=True))
    if engines or deployments:
        using = ", ".join(
            [*(f"engine {e}" for e in engines), *(f"deployment {d}" for d in deployments)]
        )
        raise UserError(f"host {name} is still used by {using}", field="name")
    with transaction.atomic():
        transitions.host_removed(host)
        record_event("host.removed", f"host {name} removed", subject=name)


def drain_host(name: str, *, actor: str = "") -> Host:
    """Drain a host: nothing new is placed on it from now on, and the scheduler's drain
    pass moves what runs there (:mod:`capyctl.scheduler.host_drains`). Draining a host
    that drains already changes nothing."""
    host = get_host(name)
    with transaction.atomic():
        if Host.objects.filter(pk=host.pk, drain_started_at__isnull=True).update(
            drain_started_at=timezone.now()
        ):
            record_event(
                "host.draining",
                f"host {name} is draining: nothing new is placed on it, and its models are "
                "moved to other hosts where they fit (or stopped, where they cannot move)",
                subject=name,
                host_id=host.pk,
                actor=actor,
            )
    host.refresh_from_db()
    return host


def undrain_host(name: str, *, actor: str = "") -> Host:
    """Take a host back: models may be placed on it again (nothing moves back by itself)."""
    host = get_host(name)
    with transaction.atomic():
        if Host.objects.filter(pk=host.pk, drain_started_at__isnull=False).update(
            drain_started_at=None
        ):
            record_event("host.undrained", f"host {name} takes models again", subject=name,
                         host_id=host.pk, actor=actor)  # fmt: skip
    host.refresh_from_db()
    return host
