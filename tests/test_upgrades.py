"""Upgrades keep the data: the migrations walked from the oldest schema with a row in every
table, and a data dir an earlier version made, upgraded by a start after a backup."""

from __future__ import annotations

import datetime as dt
import sqlite3
import stat
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, models
from django.db.migrations.loader import MigrationLoader

from capyctl import bootstrap
from capyctl.errors import UserError
from hostagent.runtime import free_port
from tests.conftest import run_program, run_programs, start_server, stop_server

# Values that would break a constraint of the oldest schema (one GPU memory figure, not two).
OVERRIDES: dict[str, dict[str, Any]] = {"deployments.deployment": {"gpu_memory_bytes": None}}


# A value of each kind of column that a later migration could lose or change.
SAMPLES: dict[str, Any] = {
    "EmailField": "alice@example.com",
    "BigIntegerField": 2**40 + 7,
    "PositiveBigIntegerField": 2**40 + 7,
    "IntegerField": 7,
    "PositiveIntegerField": 7,
    "SmallIntegerField": 7,
    "PositiveSmallIntegerField": 7,
    "FloatField": 0.5,
    "DecimalField": Decimal("0.5"),
    "DateTimeField": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    "DateField": dt.date(2026, 1, 2),
    "DurationField": dt.timedelta(seconds=5),
    "JSONField": {"kept": [1, "two"]},
    "UUIDField": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "GenericIPAddressField": "10.0.0.5",
    "BinaryField": b"\x00kept",
}


def _sample(field: models.Field[Any, Any], label: str, made: dict[str, Any]) -> Any:
    """A value for ``field``, never its default: a foreign key points at the row made for
    its model."""
    kind = field.get_internal_type()
    if field.is_relation:
        target = made.get(field.related_model._meta.label_lower)  # type: ignore[union-attr]
        value = None if target is None else target.pk
    elif field.choices:
        value = next(iter(dict(field.flatchoices)))
    elif kind in {"CharField", "TextField", "SlugField"}:
        value = f"{label}.{field.name}"[-(field.max_length or 200) :]
    elif kind == "BooleanField":
        value = not field.has_default() or not field.get_default()
    elif kind in SAMPLES:
        value = SAMPLES[kind]
    else:
        raise AssertionError(f"no sample value for {label}.{field.name} ({kind})")
    return value


def fill_every_table(state_apps: Any) -> dict[str, Any]:
    """One row in each table of a historical state, every column set, in an order that
    lets each foreign key point at a row made before it."""
    waiting = [m for m in state_apps.get_models(include_auto_created=True)
               if m._meta.managed and not m._meta.proxy]  # fmt: skip
    made: dict[str, Any] = {}
    while waiting:
        for model in waiting:
            label = model._meta.label_lower
            needs = {f.related_model._meta.label_lower for f in model._meta.concrete_fields
                     if f.is_relation and not f.null} - {label}  # fmt: skip
            if needs <= made.keys():
                break
        else:
            raise AssertionError(f"foreign keys in a circle: {[m._meta.label for m in waiting]}")
        values = {f.attname: _sample(f, label, made) for f in model._meta.concrete_fields
                  if not isinstance(f, models.AutoField)}  # fmt: skip
        values.update(OVERRIDES.get(label, {}))
        made[label] = model.objects.create(**values)
        waiting.remove(model)
    return made


def table_rows() -> dict[str, dict[Any, dict[str, Any]]]:
    """Every row of every table, by table and primary key, as the database gives it."""
    rows: dict[str, dict[Any, dict[str, Any]]] = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            if table == "django_migrations":
                continue
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")  # noqa: S608
            names = [column[0] for column in cursor.description]
            key = "id" if "id" in names else names[0]
            rows[table] = {row[names.index(key)]: dict(zip(names, row, strict=True))
                           for row in cursor.fetchall()}  # fmt: skip
    return rows


def test_every_row_survives_the_migrations_from_the_oldest_schema(migrator):
    loader = MigrationLoader(connection, ignore_no_migrations=True)
    graph = loader.graph
    oldest = [graph.root_nodes(app)[0] for app in sorted({app for app, _ in graph.nodes})]
    migrator.apply_initial_migration(oldest)
    migrator.apply_tested_migration(oldest)  # every app at its first migration
    made = fill_every_table(loader.project_state(oldest, at_end=True).apps)
    before = table_rows()
    assert all(before.values()), [table for table, rows in before.items() if not rows]

    new_state = migrator.apply_tested_migration(graph.leaf_nodes())
    after = table_rows()
    for table, rows in before.items():
        assert table in after, f"the upgrade dropped the table {table}"
        for pk, row in rows.items():
            kept = after[table].get(pk)
            assert kept is not None, f"the upgrade lost row {pk} of {table}"
            lost = {c: v for c, v in row.items() if c in kept and kept[c] != v}
            assert not lost, f"the upgrade changed {table} row {pk}: {lost} -> {kept}"
    # The data migrations carried the old meaning over: a key that named models is still
    # limited to them; an instance's key is its log file's stem.
    api_key = new_state.apps.get_model("access", "ApiKey").objects.get()
    assert api_key.limit_models is True
    instance = new_state.apps.get_model("deployments", "Instance").objects.get()
    assert instance.key == made["deployments.instance"].log_path.rsplit("/", 1)[-1][:100]


def _one_app_behind(migrator) -> tuple[str, str]:
    """Undo the newest migration of the app with the most; return what is undone."""
    graph = MigrationLoader(connection, ignore_no_migrations=True).graph
    app, newest = max(graph.leaf_nodes(), key=lambda node: len(graph.forwards_plan(node)))
    parent = next(p for p in graph.node_map[(app, newest)].parents if p.key[0] == app)
    migrator.apply_tested_migration([parent.key])
    return app, newest


def test_an_outdated_database_is_upgraded_only_by_a_start(migrator, data_dir, monkeypatch, alice):
    monkeypatch.setattr(bootstrap, "_migrated", set())
    app, newest = _one_app_behind(migrator)

    with pytest.raises(UserError) as refused:  # a command does not upgrade it
        bootstrap.migrate_database()
    assert "was made by an earlier CapyCTL (1 migration to apply)" in str(refused.value)
    if connection.vendor == "sqlite":
        assert "run `capyctl start standalone` once; it takes a backup" in str(refused.value)
        upgrade = bootstrap.migrate_database(at_start=True)
        assert upgrade is not None
        assert upgrade.backup is not None
        assert upgrade.backup.parent == data_dir / "backups"
        assert upgrade.backup.name.endswith("-before-upgrade.sqlite3")
        assert stat.S_IMODE(upgrade.backup.stat().st_mode) == 0o600
        with sqlite3.connect(upgrade.backup) as copy:
            assert copy.execute(
                "SELECT count(*) FROM django_migrations WHERE app = ? AND name = ?", (app, newest)
            ).fetchone() == (0,)
            assert copy.execute("SELECT username FROM auth_user").fetchall() == [("alice",)]
    else:  # PostgreSQL: the start refuses too, and says how to back it up first
        with pytest.raises(UserError) as at_start:
            bootstrap.migrate_database(at_start=True)
        assert "back it up first with `pg_dump --format=custom" in str(at_start.value)
        assert "--migrate`" in str(at_start.value)
        upgrade = bootstrap.migrate_database(at_start=True, migrate=True)
        assert upgrade is not None
        assert upgrade.backup is None
    assert (upgrade.applied, upgrade.created) == (1, False)
    assert upgrade.line() is not None
    assert upgrade.line().startswith("  upgraded:  1 migration applied")  # type: ignore[union-attr]
    assert bootstrap.migrate_database(at_start=True) is None  # up to date now


@pytest.mark.e2e
def test_a_data_dir_an_earlier_version_made_is_upgraded_at_start_with_a_backup(program_env):
    data_dir = Path(program_env["CAPYCTL_DATA_DIR"])
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    sim = f"{sys.executable} -m hostagent.sim vllm"
    made = run_programs(
        program_env,
        ["user", "add", "bob"],
        ["engine", "add", "sim", "--kind", "vllm", "--command", sim],
        ["deployment", "add", "chat", "--engine", "sim", "--source", "m", "--alias", "c"],
        ["key", "create", "--user", "bob", "--name", "laptop"],
    )
    assert [r.code for r in made] == [0, 0, 0, 0], made
    # As an earlier version left it: its two newest migrations not applied yet.
    root = Path(__file__).resolve().parent.parent
    made_by = sorted(p.stem for p in (root / "capyctl/deployments/migrations").glob("0*.py"))
    # Those two, and every migration of another app that builds on them.
    graph = MigrationLoader(None, ignore_no_migrations=True).graph
    behind = len(graph.backwards_plan(("deployments", made_by[-2])))
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "deployments", made_by[-3], "-v0"],
        env=program_env, check=True, cwd=root,
    )  # fmt: skip

    refused = run_program(program_env, "deployment", "list")
    assert refused.code == 2
    assert refused.err.startswith("capyctl: error: the database ")
    assert f"was made by an earlier CapyCTL ({behind} migrations to apply)" in refused.err
    assert not (data_dir / "backups").exists()

    if program_env.get("CAPYCTL_DATABASE_URL", "").startswith("postgres"):
        # PostgreSQL: the start refuses and names the pg_dump to run; --migrate upgrades.
        listen = f"127.0.0.1:{free_port()}"
        refused = run_program(program_env, "start", "standalone", "--listen", listen)
        assert refused.code == 2
        assert "back it up first with `pg_dump --format=custom" in refused.err
        assert "then run `capyctl start standalone --migrate`" in refused.err
        server = start_server(program_env, "--migrate")
        try:
            assert f"  upgraded:  {behind} migrations applied\n" in server.log()
        finally:
            stop_server(server, 15)
    else:
        server = start_server(program_env)
        try:
            banner = server.log()
        finally:
            stop_server(server, 15)
        backups = sorted((data_dir / "backups").iterdir())
        assert len(backups) == 1
        assert backups[0].name.endswith("-before-upgrade.sqlite3")
        kept = f"the database as it was is in {backups[0]}\n"
        assert f"  upgraded:  {behind} migrations applied; {kept}" in banner
        assert stat.S_IMODE(backups[0].stat().st_mode) == 0o600

    users, deployments, keys = run_programs(
        program_env, ["user", "list"], ["deployment", "list", "--json"], ["key", "list"]
    )
    assert "bob" in users.out
    assert '"name": "chat"' in deployments.out
    assert '"c"' in deployments.out
    assert "laptop" in keys.out
    if program_env.get("CAPYCTL_DATABASE_URL", "").startswith("postgres"):
        return
    # The copy taken before the upgrade comes back as it was: the earlier schema, whose
    # next start upgrades it again.
    restored = run_program(program_env, "restore", str(backups[0]))
    assert restored.code == 0, restored.err
    assert restored.out.splitlines()[-1] == (
        f"  its schema is older than this version's ({behind} migrations to apply): the next "
        "`capyctl start standalone` takes a backup, then upgrades it"
    )
    assert run_program(program_env, "deployment", "list").code == 2
