"""Copies of a standalone SQLite database, taken while it serves, and bringing one back.

A copy is made with SQLite's online backup API: one read transaction, so it is a
consistent snapshot even while the server writes (WAL lets the writes go on meanwhile).
Copies CapyCTL takes by itself (before an upgrade, before a restore, ``capyctl backup``
without a file) go to ``<data dir>/backups/``, named after the time and the schema, and
only the newest :data:`KEEP_BACKUPS` of them are kept.

A standalone server holds a shared lock on ``<data dir>/serving.lock`` while it runs; a
restore takes it exclusively, so it never replaces a database a server is serving.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from capyctl.errors import UserError
from hostagent.datadir import make_private_dir

KEEP_BACKUPS = 5
BACKUPS_DIR = "backups"
SERVING_LOCK = "serving.lock"
_PREFIX = "capyctl-"
_SUFFIX = ".sqlite3"

Migration = tuple[str, str]  # (app label, migration name)

# The serving locks this process holds, by path: held until it exits.
_serving: dict[Path, int] = {}


@dataclass(frozen=True)
class Backup:
    path: Path
    schema: int  # migrations applied in it
    size_bytes: int


def schema_label(applied: set[Migration]) -> str:
    """What a backup's name says of its schema: how many migrations were applied."""
    return f"schema{len(applied)}"


def applied_migrations(conn: sqlite3.Connection) -> set[Migration] | None:
    """The migrations recorded in a SQLite database, or ``None`` without Django's table."""
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'django_migrations'"
    ).fetchone()
    if found is None:
        return None
    return {(app, name) for app, name in conn.execute("SELECT app, name FROM django_migrations")}


def _create_private(path: Path) -> None:
    """Make ``path`` as an empty 0600 file; refuse one that exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)


def copy_database(source: Path, target: Path) -> Backup:
    """Copy the SQLite database ``source`` into the new file ``target`` (0600), as one
    consistent snapshot, in rollback-journal mode so the copy is one file."""
    _create_private(target)
    try:
        with (
            contextlib.closing(sqlite3.connect(source, timeout=20)) as src,
            contextlib.closing(sqlite3.connect(target)) as dst,
        ):
            src.backup(dst)  # all pages in one step: one snapshot of the source
            dst.execute("PRAGMA journal_mode=DELETE")
            applied = applied_migrations(dst) or set()
        target.chmod(0o600)  # the umask of a caller outside capyctl aside
        with target.open("rb") as handle:
            os.fsync(handle.fileno())
    except sqlite3.Error as exc:  # a disk full, a source that is not a database
        target.unlink(missing_ok=True)
        raise UserError(
            f"could not copy {source} to {target} ({exc}): nothing was written"
        ) from None
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return Backup(target, len(applied), target.stat().st_size)


def backup_name(applied: set[Migration], reason: str = "", now: datetime | None = None) -> str:
    moment = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    tail = f"-{reason}" if reason else ""
    return f"{_PREFIX}{moment}-{schema_label(applied)}{tail}{_SUFFIX}"


def backups_dir(data_dir: Path) -> Path:
    return data_dir / BACKUPS_DIR


def kept_backups(data_dir: Path) -> list[Path]:
    """The backups CapyCTL took into the data dir, oldest first."""
    folder = backups_dir(data_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f"{_PREFIX}*{_SUFFIX}") if p.is_file()]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def read_schema(database: Path) -> set[Migration]:
    with contextlib.closing(sqlite3.connect(database, timeout=20)) as conn:
        return applied_migrations(conn) or set()


def back_up_into_data_dir(database: Path, data_dir: Path, reason: str = "") -> Backup:
    """Copy ``database`` into ``<data dir>/backups/`` and keep only the newest
    :data:`KEEP_BACKUPS` there."""
    folder = make_private_dir(backups_dir(data_dir))
    base = backup_name(read_schema(database), reason)
    target = folder / base
    for n in range(2, 100):  # two in the same second: the second gets a number
        if not target.exists():
            break
        target = folder / base.replace(_SUFFIX, f"-{n}{_SUFFIX}")
    backup = copy_database(database, target)
    for old in kept_backups(data_dir)[:-KEEP_BACKUPS]:
        old.unlink(missing_ok=True)
    return backup


# --- serving, and restoring ----------------------------------------------------------------


def hold_serving_lock(data_dir: Path) -> None:
    """Say, for as long as this process runs, that it serves ``data_dir``: a restore
    refuses meanwhile. Several servers may hold it at once; a restore under way makes
    a start wait for nothing and refuse."""
    path = data_dir / SERVING_LOCK
    if path in _serving:
        return
    make_private_dir(data_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            f"a restore is replacing the database of {data_dir}: start again when it is done"
        ) from None
    _serving[path] = fd


@contextlib.contextmanager
def nobody_serving(data_dir: Path) -> Iterator[None]:
    """Hold ``<data dir>/serving.lock`` exclusively, or refuse while a server holds it."""
    path = data_dir / SERVING_LOCK
    make_private_dir(data_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"a CapyCTL server is serving {data_dir} (it holds {path}): stop it, then "
                "restore; nothing was changed"
            ) from None
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Checked:
    """A backup file found to be a whole CapyCTL database this code can run."""

    path: Path
    applied: set[Migration]
    pending: int  # migrations the next start applies to it


def check_backup(path: Path, known: set[Migration], own_apps: set[str]) -> Checked:
    """Refuse, with one line, a file that is not a whole CapyCTL SQLite database whose
    schema this code knows (``known``: the migrations on disk; ``own_apps``: CapyCTL's
    app labels)."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        uri = f"file:{quote(str(path))}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=20)) as conn:
            verdict = conn.execute("PRAGMA integrity_check").fetchall()
            applied = applied_migrations(conn)
    except sqlite3.DatabaseError as exc:
        raise UserError(f"{path} is not a SQLite database ({exc}): nothing was changed") from None
    if [row[0] for row in verdict] != ["ok"]:
        raise UserError(
            f"{path} fails SQLite's integrity check ({verdict[0][0]}): nothing was changed"
        )
    if applied is None or not {app for app, _ in applied} & own_apps:
        raise UserError(
            f"{path} is not a CapyCTL database (no CapyCTL migrations recorded in it): "
            "nothing was changed"
        )
    unknown = sorted(applied - known)
    if unknown:
        names = ", ".join(f"{app}.{name}" for app, name in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UserError(
            f"{path} was made by a newer CapyCTL (its schema has {names}{more}, which this "
            "version does not know): upgrade CapyCTL first; nothing was changed"
        )
    return Checked(path, applied, len(known - applied))


def replace_database(source: Path, database: Path) -> None:
    """Copy ``source`` over the SQLite database ``database`` through the backup API (so a
    stray reader sees the old database or the new, never a mix), in WAL mode as CapyCTL
    runs it."""
    if not database.exists():
        _create_private(database)
    uri = f"file:{quote(str(source))}?mode=ro"
    with (
        contextlib.closing(sqlite3.connect(uri, uri=True, timeout=20)) as src,
        contextlib.closing(sqlite3.connect(database, timeout=20)) as dst,
    ):
        page_size = "PRAGMA page_size"
        if src.execute(page_size).fetchone() != dst.execute(page_size).fetchone():
            # A WAL database cannot take the pages of one whose page size differs (an
            # older SQLite's 1024 bytes): out of WAL for the copy, then back.
            dst.execute("PRAGMA journal_mode=DELETE")
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=WAL")
        dst.execute("PRAGMA wal_checkpoint(TRUNCATE)")
