"""First-start work: the database schema, the local host and the first admin account."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

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


def migrate_database() -> bool:
    """Apply pending migrations; return whether any ran."""
    if connection.settings_dict["NAME"] in _migrated:
        return False
    _migrated.add(connection.settings_dict["NAME"])
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
