"""A host's state (seen, unreachable with its models' entries unconfirmed, answering,
removed), its foreign memory measured, and a deployment's desired state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from capyctl.deployments.models import Deployment
from capyctl.hosts.models import LOCAL_HOST_NAME, Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import (
    host_held_again,
    host_lock,
    mark_host_unconfirmed,
    set_foreign,
)
from capyctl.scheduler.transitions.base import UNREACHABLE_NOTE


def foreign_measured(host: Host, figures: Mapping[str, int]) -> None:
    """Memory used by processes CapyCTL did not start, per pool, as the probe reads it; a
    figure never takes a pool past what CapyCTL's own entries leave."""
    with host_lock(host.pk) as locked:
        usage = {u.pool: u for u in pool_usage(locked)}
        allowed = {}
        for pool, foreign in figures.items():
            if pool not in usage:
                continue
            counted = usage[pool]
            room = counted.capacity_bytes - (counted.used_bytes - counted.foreign_bytes)
            allowed[pool] = min(foreign, max(room, 0))
        set_foreign(locked, allowed)


def local_host_seen(inventory: Mapping[str, Any]) -> tuple[Host, bool]:
    """The in-process host ``local``, made or refreshed with what the probe sees now:
    online. Returns it, and whether it was made now."""
    now = timezone.now()
    seen = {"is_local": True, "state": Host.State.ONLINE, "inventory": dict(inventory),
            "last_seen_at": now}  # fmt: skip
    with transaction.atomic():
        host, created = Host.objects.get_or_create(name=LOCAL_HOST_NAME, defaults=seen)
        if not created:
            Host.objects.filter(pk=host.pk).update(**seen)
            host.refresh_from_db()
    return host, created


def host_unreachable(host: Host) -> bool:
    """-> UNREACHABLE, and what the host's models hold stays counted, as memory nobody can
    confirm now: both in one transaction. False: it was unreachable already."""
    with host_lock(host.pk) as locked:
        rows = Host.objects.filter(pk=locked.pk).exclude(state=Host.State.UNREACHABLE)
        if not rows.update(state=Host.State.UNREACHABLE):
            return False
        mark_host_unconfirmed(locked, UNREACHABLE_NOTE)
    return True


def host_answers(host: Host, inventory: Mapping[str, Any], *, pin: str) -> str | None:
    """-> ONLINE with the ``inventory`` it reported, only while it still holds the
    certificate ``pin`` the call trusted (a revoke that landed meanwhile is not undone).
    If it was unreachable, what was unconfirmed for that reason counts as held again
    (reconcile then finds out which engines are still there). Returns the state it was in;
    None: its certificate changed meanwhile, and nothing changed."""
    with host_lock(host.pk) as locked:
        rows = Host.objects.filter(pk=locked.pk, cert_fingerprint=pin).exclude(cert_fingerprint="")
        if not rows.update(
            state=Host.State.ONLINE, inventory=dict(inventory), last_seen_at=timezone.now()
        ):
            return None
        if locked.state == Host.State.UNREACHABLE:
            host_held_again(locked, UNREACHABLE_NOTE)
    return str(locked.state)


def host_removed(host: Host) -> None:
    """The host is forgotten, with the memory its ledger counted as foreign (no model is
    placed on it, so it counts nothing else: the caller checked)."""
    with host_lock(host.pk) as locked:
        pools = LedgerEntry.objects.filter(host=locked, deployment__isnull=True)
        set_foreign(locked, dict.fromkeys(pools.values_list("pool", flat=True), 0))
        locked.delete()


def desired(deployment_id: int, value: str) -> None:
    """A person's intent for the deployment: ``running`` or ``stopped`` (its desired state;
    the scheduler acts on it), and its replicas'."""
    Deployment.objects.filter(Q(pk=deployment_id) | Q(replica_of_id=deployment_id)).update(
        desired_state=value
    )
