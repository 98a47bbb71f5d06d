"""Ledger admission and bookkeeping: the only code that writes LedgerEntry rows.

Every change runs inside :func:`host_lock`: a transaction that holds the host row
``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite every transaction already begins
IMMEDIATE (see settings), which takes the database's write lock at BEGIN. So admission's
check and its write never interleave with another writer's, and a pool's entries can
never add up to more than its capacity.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from capyctl.errors import UserError
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import LedgerRead, PoolUsage, pool_usage, read_ledger
from hostagent.units import format_size

Status = LedgerEntry.Status


class InsufficientMemoryError(UserError):
    """Admission refused: the named pools lack the bytes asked for."""

    def __init__(self, message: str, short: dict[str, int]) -> None:
        super().__init__(message)
        self.short = short


@contextmanager
def host_lock(host: int | Host) -> Iterator[Host]:
    """Hold the host's ledger lock for the duration of the block (one transaction); yields
    the host's row.

    Given by id, the row is read under the lock. Given as a row the caller read during
    this operation, that row stands for it where the lock is the transaction itself
    (SQLite: its BEGIN IMMEDIATE takes the write lock, and reading the row again adds
    nothing to it); where the lock is the row's ``SELECT … FOR UPDATE`` (PostgreSQL), the
    row is read as it is taken.
    """
    with transaction.atomic():
        if isinstance(host, Host) and not connection.features.has_select_for_update:
            yield host
        else:
            host_id = host.pk if isinstance(host, Host) else host
            yield Host.objects.select_for_update().get(pk=host_id)


def admit(
    host: Host,
    deployment_id: int,
    need: Mapping[str, int],
    *,
    status: str = Status.PROMISED,
    note: str = "",
    current_entries: Mapping[str, int] | None = None,
    read: LedgerRead | None = None,
) -> None:
    """Promise ``need`` (pool → bytes) to a deployment, or raise InsufficientMemoryError.

    Must run inside :func:`host_lock`; ``current_entries`` (pool -> bytes of the
    deployment's entries) saves a query when the caller has just read them, and ``read``
    (the host's entries, read under this lock hold, none written since) saves both. An
    entry the deployment already has in a pool is replaced (its old bytes are not counted
    twice): admission asks for the total it will hold there, not an increment.
    """
    if read is not None:
        usage = {p.pool: p for p in read.usage()}
        current_entries = read.entries(deployment_id)
    else:
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
    read = read_ledger(host)  # the pools' usage and its own entries, in one query
    usage = {p.pool: p for p in read.usage()}
    mine = read.entries(deployment_id)
    over: dict[str, int] = {}
    recorded: dict[str, int] = {}
    for pool, measured in figures.items():
        room = usage[pool].free_bytes + mine.get(pool, 0) if pool in usage else measured
        recorded[pool] = min(max(measured, 0), max(room, 0))
        if measured > recorded[pool]:
            over[pool] = measured - recorded[pool]
    _put_all(host, deployment_id, recorded, status=Status.HELD, note=note, existing=mine)
    return over


def _put_all(
    host: Host,
    deployment_id: int,
    figures: Mapping[str, int],
    *,
    status: str,
    note: str,
    existing: Collection[str],
) -> None:
    """:func:`_put` for several pools of one deployment: the entries it has (``existing``,
    read under this lock hold) in one UPDATE, the others created."""
    pools = [pool for pool in figures if pool in existing]
    rest = [pool for pool in figures if pool not in existing]
    if len(pools) > 1:
        table = connection.ops.quote_name(LedgerEntry._meta.db_table)
        cases = " ".join("WHEN %s THEN CAST(%s AS BIGINT)" for _ in pools)
        marks = ", ".join("%s" for _ in pools)
        params: list[Any] = [value for pool in pools for value in (pool, figures[pool])]
        params += [status, note, timezone.now(), host.pk, deployment_id, *pools]
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET bytes = CASE pool {cases} END, status = %s, note = %s, "  # noqa: S608 - our own table name
                f"updated_at = %s WHERE host_id = %s AND deployment_id = %s AND pool IN ({marks})",
                params,
            )
            if cursor.rowcount != len(pools):  # not as read: each on its own
                rest = list(figures)
    else:
        rest = list(figures)
    for pool in rest:
        _put(host, deployment_id, pool, figures[pool], status=status, note=note)


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
