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


def migrate_database() -> bool:
    """Apply pending migrations; return whether any ran."""
    if connection.settings_dict["NAME"] in _migrated:
        return False
    _migrated.add(connection.settings_dict["NAME"])
    if _every_migration_file_applied():
        return False
    from django.core.management import call_command
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if not plan:
        return False
    call_command("migrate", interactive=False, verbosity=0)
    return True


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


def prepare_standalone() -> None:
    """Everything standalone needs before serving: schema and the local host."""
    from capyctl.hosts.services import ensure_local_host
    from hostagent.probe import read_inventory

    migrate_database()
    ensure_local_host(
        read_inventory(settings.CAPYCTL["SIM_GPUS"], settings.CAPYCTL["SIM_STATE_DIR"])
    )
