"""Handlers of ``capyctl backup`` and ``capyctl restore``: the standalone SQLite database.

Neither migrates: a backup copies the database as it is (the point of one taken before an
upgrade), and a restored backup of an earlier schema is upgraded by the next start, which
takes a backup first. Server mode's PostgreSQL is backed up with ``pg_dump`` and restored
with ``pg_restore`` (docs/upgrades.md); both commands say so there.
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

from django.conf import settings

from capyctl import backups
from capyctl.bootstrap import (
    known_migrations,
    migrations_text,
    own_app_labels,
    pg_dump_command,
    sqlite_database,
)
from capyctl.cli.serving import serving
from capyctl.errors import UserError
from hostagent.units import format_size


def _database(verb: str) -> Path:
    database = sqlite_database()
    if database is None:
        if verb == "back up":
            how = f"`{pg_dump_command('capyctl.dump')}`"
        else:
            how = "`pg_restore --clean --if-exists --dbname=NAME FILE` (see docs/upgrades.md)"
        raise UserError(f"capyctl cannot {verb} a PostgreSQL database: use {how}")
    return database


def backup(args: argparse.Namespace) -> int:
    """Copy the database, consistent even while a server writes to it, to FILE or into
    ``<data dir>/backups/`` (keeping the newest few there)."""
    database = _database("back up")
    if not database.is_file():
        raise UserError(f"there is no database at {database} yet: nothing to back up")
    data_dir = Path(settings.DATA_DIR)
    if args.file is None:
        made = backups.back_up_into_data_dir(database, data_dir)
    else:
        target = Path(args.file).expanduser().absolute()
        if target.is_dir():
            target /= backups.backup_name(backups.read_schema(database))
        if target.exists():
            raise UserError(f"{target} exists already: name a new file; nothing was written")
        if not target.parent.is_dir():
            raise UserError(f"{target.parent}: no such directory; nothing was written")
        made = backups.copy_database(database, target)
    print(
        f"backed up {database} (schema {made.schema}, {format_size(made.size_bytes)}) "
        f"to {made.path}"
    )
    return 0


def restore(args: argparse.Namespace) -> int:
    """Replace the database with the backup FILE, after checking it is a whole CapyCTL
    database of a schema this version knows, and with no server serving the data dir.
    The database it replaces is kept in ``<data dir>/backups/``."""
    database = _database("restore")
    source = Path(args.file).expanduser().absolute()
    data_dir = Path(settings.DATA_DIR)
    running = serving(data_dir)  # which server, to say so; the lock below is the guard
    if running is not None:
        raise UserError(
            f"a CapyCTL server is serving {data_dir} (pid {running.pid}, since "
            f"{running.since_text()}): stop it, then restore; nothing was changed"
        )
    with backups.nobody_serving(data_dir):
        checked = backups.check_backup(source, known_migrations(), own_app_labels())
        kept = None
        if database.is_file():
            kept = backups.back_up_into_data_dir(database, data_dir, "before-restore")
        try:
            backups.replace_database(source, database)
        except sqlite3.Error as exc:
            kept_note = f"; the database as it was is in {kept.path}" if kept else ""
            raise UserError(f"could not restore {source} ({exc}){kept_note}") from None
    print(f"restored {database} from {source} (schema {len(checked.applied)})")
    if kept is not None:
        print(f"  the database it replaced is in {kept.path}")
    if checked.pending:
        print(
            f"  its schema is older than this version's ({migrations_text(checked.pending)} "
            "to apply): the next `capyctl start standalone` takes a backup, then upgrades it"
        )
    return 0
