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
    return read_ledger(host).usage()


@dataclass(frozen=True)
class LedgerRead:
    """A host's ledger entries as one query read them: ``(deployment id or None, pool,
    status, bytes)`` each. Read under the host lock, it stands for the ledger until this
    lock hold writes an entry: a step that needs the pools' usage, a deployment's entries
    and the residents' reads them once."""

    host: Host
    rows: tuple[tuple[int | None, str, str, int], ...]

    def usage(self) -> list[PoolUsage]:
        """As :func:`pool_usage`."""
        sums: dict[tuple[str, str], int] = {}
        for _, pool, status, num_bytes in self.rows:
            sums[(pool, status)] = sums.get((pool, status), 0) + num_bytes
        result = []
        for each in self.host.pools():
            name = each["pool"]
            total = int(each["total_bytes"])
            reserve = min(reserve_for(self.host, name), total)
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

    def entries(self, deployment_id: int) -> dict[str, int]:
        """The deployment's entries (pool -> bytes)."""
        return {pool: b for owner, pool, _, b in self.rows if owner == deployment_id}


def read_ledger(host: Host) -> LedgerRead:
    """Every ledger entry of ``host`` now, in one plain query."""
    # Read on every admission, inside the host lock: one plain query, not the ORM's query
    # building (several ms a call on a small machine).
    table = connection.ops.quote_name(LedgerEntry._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT deployment_id, pool, status, bytes FROM {table} "  # noqa: S608 - our own table name
            "WHERE host_id = %s",
            [host.pk],
        )
        rows = tuple(
            (None if owner is None else int(owner), pool, status, int(num_bytes or 0))
            for owner, pool, status, num_bytes in cursor.fetchall()
        )
    return LedgerRead(host, rows)
