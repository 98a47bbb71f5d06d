"""Pools and their capacities, and what the ledger counts in each."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

from django.conf import settings
from django.db import connection

from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry


def device_total(host: Host) -> int:
    """The smallest GPU's total memory on ``host`` (0 without GPUs): what a claim given as
    a share of a device is a share of."""
    gpus = (host.inventory or {}).get("gpus") or []
    return min((int(g["total_bytes"]) for g in gpus), default=0)


@dataclass(frozen=True)
class PoolUsage:
    """One pool of one host: capacity (total - reserve) and bytes by ledger status."""

    pool: str
    total_bytes: int
    reserve_bytes: int
    capacity_bytes: int
    held_bytes: int = 0
    promised_bytes: int = 0
    unconfirmed_bytes: int = 0
    foreign_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return self.held_bytes + self.promised_bytes + self.unconfirmed_bytes + self.foreign_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "used_bytes": self.used_bytes, "free_bytes": self.free_bytes}


def reserve_for(host: Host, pool: str) -> int:
    """Bytes kept free in ``pool``: the host's own setting, else the global default."""
    if pool.startswith("gpu"):
        own = host.gpu_reserve_bytes
        return own if own is not None else cast(int, settings.CAPYCTL["GPU_RESERVE_BYTES"])
    own = host.ram_reserve_bytes
    return own if own is not None else cast(int, settings.CAPYCTL["RAM_RESERVE_BYTES"])


def pool_usage(host: Host) -> list[PoolUsage]:
    """Every pool of ``host`` with what the ledger counts in it now."""
    sums: dict[tuple[str, str], int] = {}
    # Read on every admission, inside the host lock: one plain aggregate, not the ORM's
    # query building (several ms a call on a small machine).
    table = connection.ops.quote_name(LedgerEntry._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT pool, status, SUM(bytes) FROM {table} "  # noqa: S608 - our own table name
            "WHERE host_id = %s GROUP BY pool, status",
            [host.pk],
        )
        for pool, status, total in cursor.fetchall():
            sums[(pool, status)] = int(total or 0)
    result = []
    for pool in host.pools():
        name = pool["pool"]
        total = int(pool["total_bytes"])
        reserve = min(reserve_for(host, name), total)
        result.append(
            PoolUsage(
                pool=name,
                total_bytes=total,
                reserve_bytes=reserve,
                capacity_bytes=total - reserve,
                held_bytes=sums.get((name, LedgerEntry.Status.HELD), 0),
                promised_bytes=sums.get((name, LedgerEntry.Status.PROMISED), 0),
                unconfirmed_bytes=sums.get((name, LedgerEntry.Status.UNCONFIRMED), 0),
                foreign_bytes=sums.get((name, LedgerEntry.Status.FOREIGN), 0),
            )
        )
    return result
