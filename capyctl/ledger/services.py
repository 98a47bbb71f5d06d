"""Ledger admission and bookkeeping: the only code that writes LedgerEntry rows.

Every change runs inside :func:`host_lock`: a transaction that holds the host row
``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite every transaction already begins
IMMEDIATE (see settings), which takes the database's write lock at BEGIN. So admission's
check and its write never interleave with another writer's, and a pool's entries can
never add up to more than its capacity.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from capyctl.errors import UserError
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import PoolUsage, pool_usage
from hostagent.units import format_size

Status = LedgerEntry.Status


class InsufficientMemoryError(UserError):
    """Admission refused: the named pools lack the bytes asked for."""

    def __init__(self, message: str, short: dict[str, int]) -> None:
        super().__init__(message)
        self.short = short


@contextmanager
def host_lock(host_id: int) -> Iterator[Host]:
    """Hold the host's ledger lock for the duration of the block (one transaction)."""
    with transaction.atomic():
        yield Host.objects.select_for_update().get(pk=host_id)


def admit(
    host: Host,
    deployment_id: int,
    need: Mapping[str, int],
    *,
    status: str = Status.PROMISED,
    note: str = "",
    current_entries: Mapping[str, int] | None = None,
) -> None:
    """Promise ``need`` (pool → bytes) to a deployment, or raise InsufficientMemoryError.

    Must run inside :func:`host_lock`; ``current_entries`` (pool -> bytes of the
    deployment's entries) saves a query when the caller has just read them. An entry the
    deployment already has in a pool is replaced (its old bytes are not counted twice):
    admission asks for the total it will hold there, not an increment.
    """
    usage = {p.pool: p for p in pool_usage(host)}
    if current_entries is None:  # the caller may pass the deployment's entries it just read
        current_entries = dict(
            LedgerEntry.objects.filter(host=host, deployment_id=deployment_id).values_list(
                "pool", "bytes"
            )
        )
    short: dict[str, int] = {}
    for pool, num_bytes in need.items():
        if pool not in usage:
            raise UserError(f"host {host.name} has no pool {pool!r}")
        mine = current_entries.get(pool, 0)
        free = usage[pool].free_bytes + mine
        if num_bytes > free:
            short[pool] = num_bytes - free
    if short:
        detail = ", ".join(
            f"{pool} needs {format_size(need[pool])}, has {format_size(need[pool] - lack)} free"
            for pool, lack in sorted(short.items())
        )
        raise InsufficientMemoryError(f"not enough memory on {host.name}: {detail}", short)
    for pool, num_bytes in need.items():
        _put(host, deployment_id, pool, num_bytes, status=status, note=note)


def _put(
    host: Host, deployment_id: int | None, pool: str, num_bytes: int, *, status: str, note: str
) -> None:
    # The hot path of every switch: one plain UPDATE (the ORM's query building costs about
    # ten times the statement here), an INSERT through the ORM only for a new entry.
    table = connection.ops.quote_name(LedgerEntry._meta.db_table)
    who = "deployment_id IS NULL" if deployment_id is None else "deployment_id = %s"
    params: list[Any] = [num_bytes, status, note, timezone.now(), host.pk, pool]
    if deployment_id is not None:
        params.append(deployment_id)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET bytes = %s, status = %s, note = %s, updated_at = %s "  # noqa: S608 - our own table name
            f"WHERE host_id = %s AND pool = %s AND {who}",
            params,
        )
        updated = cursor.rowcount
    if not updated:
        LedgerEntry.objects.create(
            host=host,
            deployment_id=deployment_id,
            pool=pool,
            bytes=num_bytes,
            status=status,
            note=note,
        )


def set_measured(
    host: Host, deployment_id: int, figures: Mapping[str, int], *, note: str = "measured"
) -> dict[str, int]:
    """Record what the probe measured a deployment holding, as ``held``.

    A figure never takes a pool past its capacity: what exceeds the room left is not
    admitted but returned (pool -> bytes over), for the caller to report. The pool's
    reserve is what absorbs such an overshoot on the device itself. Must run inside
    :func:`host_lock`.
    """
    usage = {p.pool: p for p in pool_usage(host)}
    mine = dict(
        LedgerEntry.objects.filter(host=host, deployment_id=deployment_id).values_list(
            "pool", "bytes"
        )
    )
    over: dict[str, int] = {}
    for pool, measured in figures.items():
        room = usage[pool].free_bytes + mine.get(pool, 0) if pool in usage else measured
        recorded = min(max(measured, 0), max(room, 0))
        if measured > recorded:
            over[pool] = measured - recorded
        _put(host, deployment_id, pool, recorded, status=Status.HELD, note=note)
    return over


def release(host: Host, deployment_id: int, pools: list[str] | None = None) -> None:
    """Drop a deployment's entries (all, or the given pools): the probe showed them free."""
    entries = LedgerEntry.objects.filter(host=host, deployment_id=deployment_id)
    if pools is not None:
        entries = entries.filter(pool__in=pools)
    entries.delete()


def mark_unconfirmed(host: Host, deployment_id: int, note: str) -> None:
    """Keep counting what a deployment held, as memory not yet confirmed released."""
    LedgerEntry.objects.filter(host=host, deployment_id=deployment_id).update(
        status=Status.UNCONFIRMED, note=note
    )


def mark_host_unconfirmed(host: Host, note: str) -> None:
    """Keep counting what every deployment on the host holds or was promised, as memory
    nobody can confirm now (``note`` says why; :func:`host_held_again` undoes it)."""
    LedgerEntry.objects.filter(
        host=host, deployment__isnull=False, status__in=[Status.HELD, Status.PROMISED]
    ).update(status=Status.UNCONFIRMED, note=note)


def host_held_again(host: Host, note: str) -> None:
    """The host's entries made unconfirmed for ``note`` count as held again (their note
    cleared): the host answers again."""
    LedgerEntry.objects.filter(host=host, status=Status.UNCONFIRMED, note=note).update(
        status=Status.HELD, note=""
    )


def held_again(host: Host, deployment_id: int) -> None:
    """A deployment's entries still unconfirmed count as held again (their notes kept):
    the probe has shown its released memory free."""
    LedgerEntry.objects.filter(
        host=host, deployment_id=deployment_id, status=Status.UNCONFIRMED
    ).update(status=Status.HELD)


def set_foreign(host: Host, figures: Mapping[str, int]) -> None:
    """Record memory used by processes CapyCTL did not start (0 removes the entry)."""
    for pool, num_bytes in figures.items():
        if num_bytes <= 0:
            LedgerEntry.objects.filter(host=host, deployment__isnull=True, pool=pool).delete()
        else:
            _put(host, None, pool, num_bytes, status=Status.FOREIGN, note="not started by CapyCTL")


def overcommitted(host: Host) -> list[PoolUsage]:
    """Pools whose entries add up to more than their capacity (must always be empty)."""
    return [usage for usage in pool_usage(host) if usage.used_bytes > usage.capacity_bytes]
