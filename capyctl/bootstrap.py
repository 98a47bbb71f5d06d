"""First-start work: the database schema, the local host and the first admin account."""

from __future__ import annotations

import os
import pkgutil
import secrets
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

from capyctl.errors import UserError
from hostagent.datadir import make_private_dir

# Databases this process has already brought up to date.
_migrated: set[str] = set()

ADMIN_PASSWORD_FILE = "initial-admin-password"  # noqa: S105 - a file name, not a secret


@dataclass(frozen=True)
class AdminAccount:
    username: str
    password_file: Path | None
    password: str | None  # only when it was made just now
    created: bool


def _every_migration_file_applied() -> bool:
    """Whether each migration file of each installed app is recorded as applied.

    Then the plan is empty, and a command is spared importing every migration to build
    the graph. It reads the files as :class:`MigrationLoader` finds them; when it says
    no (a new file, a squash, a new database), the migration executor decides.
    """
    recorder = MigrationRecorder(connection)
    if not recorder.has_table():
        return False
    applied = set(recorder.applied_migrations())
    for app_config in apps.get_app_configs():
        module_name, _ = MigrationLoader.migrations_module(app_config.label)
        if module_name is None:
            continue
        try:
            module = import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # no migrations package: the loader counts the app unmigrated
            return False  # something inside is missing: the executor says what
        for _, name, is_pkg in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if not is_pkg and name[0] not in "_~" and (app_config.label, name) not in applied:
                return False
    return True


@dataclass(frozen=True)
class SchemaUpgrade:
    """What bringing the database up to date did."""

    applied: int  # migrations applied
    created: bool  # a new database: nothing was there to keep
    backup: Path | None  # SQLite: the copy of the database as it was, taken first

    def line(self) -> str | None:
        """The start's line on it (a new database goes without saying)."""
        if self.created:
            return None
        kept = f"; the database as it was is in {self.backup}" if self.backup else ""
        return f"  upgraded:  {migrations_text(self.applied)} applied{kept}"


def migrations_text(count: int) -> str:
    """``1 migration``, ``3 migrations``."""
    return f"{count} migration{'' if count == 1 else 's'}"


def known_migrations() -> set[tuple[str, str]]:
    """Every migration this code has, as (app label, name)."""
    return set(MigrationLoader(None, ignore_no_migrations=True).disk_migrations)


def own_app_labels() -> set[str]:
    """CapyCTL's own apps (Django's contrib apps aside)."""
    return {c.label for c in apps.get_app_configs() if c.name.startswith("capyctl.")}


def sqlite_database() -> Path | None:
    """The SQLite database file, or ``None`` on PostgreSQL (or SQLite in memory)."""
    db = settings.DATABASES["default"]
    if not db["ENGINE"].endswith("sqlite3") or str(db["NAME"]) == ":memory:":
        return None
    return Path(db["NAME"])


def pg_dump_command(file: str = "capyctl-before-upgrade.dump") -> str:
    """The ``pg_dump`` line that backs up this PostgreSQL database (its password never
    shown: pg_dump asks for it, or reads PGPASSWORD or ~/.pgpass)."""
    import shlex

    db = settings.DATABASES["default"]
    parts = ["pg_dump", "--format=custom", f"--file={file}"]
    for flag, key in (("--host", "HOST"), ("--port", "PORT"), ("--username", "USER")):
        if db.get(key):
            parts.append(f"{flag}={db[key]}")
    parts.append(str(db["NAME"]))
    return shlex.join(parts)


def _start_command() -> str:
    return f"capyctl start {'server' if settings.MODE == 'server' else 'standalone'}"


def _outdated(pending: int) -> UserError:
    """Why an outdated database is not migrated here, and what to run."""
    where = connection.settings_dict["NAME"]
    what = (
        f"the database {where} was made by an earlier CapyCTL ({migrations_text(pending)} to apply)"
    )
    if sqlite_database() is not None:
        return UserError(
            f"{what}: run `{_start_command()}` once; it takes a backup, then upgrades it"
        )
    return UserError(
        f"{what}: back it up first with `{pg_dump_command()}`, then run "
        f"`{_start_command()} --migrate`"
    )


def migrate_database(*, at_start: bool = False, migrate: bool = False) -> SchemaUpgrade | None:
    """Bring the database up to date; ``None`` when it already was.

    A new database is made at once. One an earlier version made is upgraded only by a
    start (``at_start``): SQLite after a copy of it is taken into ``<data dir>/backups/``;
    PostgreSQL only with ``migrate`` (the user ran ``pg_dump`` first). Anywhere else, or
    without ``migrate``, it raises a :class:`UserError` that says what to run.
    """
    name = connection.settings_dict["NAME"]
    if name in _migrated:
        return None
    if _every_migration_file_applied():
        _migrated.add(name)
        return None
    from django.core.management import call_command
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if not plan:
        _migrated.add(name)
        return None
    created = not executor.recorder.applied_migrations()
    backup = None
    if not created:
        database = sqlite_database()
        if not at_start or (database is None and not migrate):
            raise _outdated(len(plan))
        if database is not None:
            from capyctl.backups import back_up_into_data_dir

            backup = back_up_into_data_dir(database, Path(settings.DATA_DIR), "before-upgrade")
    try:
        call_command("migrate", interactive=False, verbosity=0)
    except Exception as exc:
        if backup is None:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"the upgrade failed ({first}); the database as it was is in {backup.path}: "
            f"`capyctl restore {backup.path}` brings it back"
        ) from exc
    _migrated.add(name)
    return SchemaUpgrade(len(plan), created, backup.path if backup else None)


def ensure_first_admin() -> AdminAccount:
    """Make the first staff account, ``admin``, if there is no superuser yet.

    Its password comes from ``CAPYCTL_ADMIN_PASSWORD`` or is generated and written to
    ``<data dir>/initial-admin-password`` (mode 0600) so it can be read again later.
    """
    from django.contrib.auth import get_user_model

    from capyctl.events.services import record_event

    user_model = get_user_model()
    password_file = Path(settings.DATA_DIR) / ADMIN_PASSWORD_FILE
    existing = user_model.objects.filter(is_superuser=True).order_by("pk").first()
    if existing is not None:
        return AdminAccount(
            username=existing.get_username(),
            password_file=password_file if password_file.exists() else None,
            password=None,
            created=False,
        )
    given = os.environ.get("CAPYCTL_ADMIN_PASSWORD")
    password = given or secrets.token_urlsafe(12)
    user_model.objects.create_superuser(username="admin", email="", password=password)
    written: Path | None = None
    if not given:
        make_private_dir(password_file.parent)
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(password + "\n")
        written = password_file
    record_event("user.added", "first admin account 'admin' created", subject="admin")
    return AdminAccount(username="admin", password_file=written, password=password, created=True)


def prepare_standalone(*, migrate: bool = False) -> SchemaUpgrade | None:
    """Everything standalone needs before serving: the serving lock (a restore refuses
    while it is held), the schema (see :func:`migrate_database`) and the local host."""
    from capyctl.backups import hold_serving_lock
    from capyctl.scheduler.host_states import ensure_local_host
    from hostagent.probe import read_inventory

    hold_serving_lock(Path(settings.DATA_DIR))
    upgrade = migrate_database(at_start=True, migrate=migrate)
    ensure_local_host(
        read_inventory(settings.CAPYCTL["SIM_GPUS"], settings.CAPYCTL["SIM_STATE_DIR"])
    )
    return upgrade
