"""A database that refuses one kind of write with an error of its own (as a constraint or a
permission would), by a trigger, on SQLite and PostgreSQL alike: a real failure at a chosen
point of a multi-step write."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection


@contextmanager
def refused(table: str, event: str, when: str = "") -> Iterator[None]:
    """While inside, the database refuses ``event`` (INSERT, UPDATE or DELETE) on
    ``table`` (only rows where ``when`` holds, an SQL condition on NEW or OLD), saying
    ``refused by the database``."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE OR REPLACE FUNCTION capyctl_refuse() RETURNS trigger AS "
                "$$ BEGIN RAISE EXCEPTION 'refused by the database'; END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                f"CREATE TRIGGER capyctl_refuse BEFORE {event} ON {table} FOR EACH ROW "
                f"{f'WHEN ({when})' if when else ''} EXECUTE FUNCTION capyctl_refuse()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER capyctl_refuse BEFORE {event} ON {table} "
                f"{f'WHEN {when}' if when else ''} "
                "BEGIN SELECT RAISE(ABORT, 'refused by the database'); END"
            )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER IF EXISTS capyctl_refuse ON {table}")
                cursor.execute("DROP FUNCTION IF EXISTS capyctl_refuse()")
            else:
                cursor.execute("DROP TRIGGER IF EXISTS capyctl_refuse")
