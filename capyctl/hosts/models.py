"""Machines that run engines."""

from __future__ import annotations

from typing import Any

from django.db import models

LOCAL_HOST_NAME = "local"


class Host(models.Model):
    """A machine with GPUs (or none) that runs engines.

    Standalone has one host, ``local``, driven in-process. Remote hosts run the host agent
    and are reached at ``address`` over mutual TLS. ``inventory`` is the latest report of
    the host's devices: ``{"unified": bool, "gpus": [{"index", "name", "total_bytes"}],
    "ram_total_bytes": int, "probe": "nvml"|"simulated"|"none", "measures": "per process"|
    "device before/after", "measures_reason": str}``. The ledger's pools and their
    capacities come from it. The row is also the ledger's lock: admission runs inside
    a transaction holding ``SELECT … FOR UPDATE`` on it.
    """

    class State(models.TextChoices):
        ONLINE = "online"
        UNREACHABLE = "unreachable"
        UNKNOWN = "unknown"

    name = models.CharField(max_length=63, unique=True)
    address = models.CharField(
        max_length=255, blank=True, help_text="HOST:PORT of the agent; empty for the local host"
    )
    is_local = models.BooleanField(default=False, help_text="driven in-process (standalone)")
    state = models.CharField(max_length=16, choices=State.choices, default=State.UNKNOWN)
    inventory = models.JSONField(default=dict, blank=True)
    gpu_reserve_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="kept free on each GPU; empty = global default"
    )
    ram_reserve_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="kept free in host RAM; empty = global default"
    )
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # Set by `capyctl host drain`: nothing new is placed here, and its models are moved.
    drain_started_at = models.DateTimeField(null=True, blank=True, editable=False)
    heartbeat_at = models.DateTimeField(
        null=True, blank=True, help_text="last beat of the scheduler loop driving this host"
    )
    join_secret_hmac = models.CharField(
        max_length=64, blank=True, editable=False, help_text="of the unused join token"
    )
    join_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    enrolled_at = models.DateTimeField(null=True, blank=True, editable=False)
    cert_fingerprint = models.CharField(
        max_length=64, blank=True, editable=False, help_text="SHA-256 of its certificate"
    )
    cert_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A new row, or the named fields of an existing one: a full save would write back
        ``state`` as it was read, undoing what happened meanwhile (a host's state is
        written only by :mod:`capyctl.scheduler.transitions`, with its ledger)."""
        if not self._state.adding and kwargs.get("update_fields") is None:
            raise TypeError("Host.save() of an existing row needs update_fields")
        super().save(*args, **kwargs)

    @property
    def measures(self) -> str | None:
        """How the host measures its engines' GPU memory, ``per process`` or ``device
        before/after`` (docs/engines.md), or ``None`` before it first reported."""
        if not self.inventory:
            return None
        return str(self.inventory.get("measures") or "per process")  # older agents: per process

    def pools(self) -> list[dict[str, Any]]:
        """The ledger pools this host's inventory implies, with total bytes."""
        inventory = self.inventory or {}
        ram_total = int(inventory.get("ram_total_bytes") or 0)
        gpus = inventory.get("gpus") or []
        if inventory.get("unified"):
            total = int(gpus[0]["total_bytes"]) if gpus else ram_total
            return [{"pool": "unified", "total_bytes": total}]
        pools = [
            {"pool": f"gpu{gpu['index']}", "total_bytes": int(gpu["total_bytes"])} for gpu in gpus
        ]
        pools.append({"pool": "ram", "total_bytes": ram_total})
        return pools
