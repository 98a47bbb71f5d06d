"""`capyctl backup` and `capyctl restore`: a copy taken while requests are served comes back
whole; a file that is not a CapyCTL database of a schema this version knows is refused."""

from __future__ import annotations

import contextlib
import sqlite3
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings
from django.db import connection

from tests.conftest import run_program, run_programs, table_counts
from tests.live_server import CAPYCTL, LiveServer, sim_engine


def _rows(database: Path, sql: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as conn:
        return conn.execute(sql).fetchall()


def _program(server: LiveServer, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CAPYCTL, *argv], env=server.env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def _chat(client: httpx.Client, key: str) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )


@pytest.mark.e2e
def test_a_backup_taken_while_requests_are_served_restores_whole(tmp_path):
    with LiveServer(settings={"CAPYCTL_SIM_LOAD_SECONDS": "0"}) as server:
        server.start(sim_engine("sim", {}), ["deployment", "add", "chat", "--engine", "sim",
                                             "--source", "m-chat"])  # fmt: skip
        database = server.data / "capyctl.sqlite3"
        answered = 0
        stop = threading.Event()

        def ask() -> None:  # requests, one after another, each recorded as a trace row
            nonlocal answered
            with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as client:
                while not stop.is_set():
                    reply = _chat(client, server.key)
                    assert reply.status_code == 200, reply.text
                    answered += 1

        asking = threading.Thread(target=ask)
        asking.start()
        try:
            deadline = time.monotonic() + 30
            while not _rows(database, "SELECT count(*) FROM traces_requesttrace")[0][0]:
                assert time.monotonic() < deadline, "no trace was written"
                time.sleep(0.05)
            copy = tmp_path / "during.sqlite3"
            count = "SELECT count(*) FROM traces_requesttrace"
            live_at_start = _rows(database, count)[0][0]
            taken = _program(server, "backup", str(copy))
            answered_by_then = answered
            busy_later = _program(server, "restore", str(copy))  # a server holds the data dir
        finally:
            stop.set()
            asking.join()
        assert taken.returncode == 0, taken.stderr
        assert taken.stdout.startswith(f"backed up {database} (schema ")
        assert taken.stdout.rstrip().endswith(f"to {copy}")
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        assert busy_later.returncode == 2
        pid = server.process.pid  # type: ignore[union-attr]
        assert busy_later.stderr.startswith(
            f"capyctl: error: a CapyCTL server is serving {server.data} (pid {pid}, since "
        )
        assert busy_later.stderr.endswith("): stop it, then restore; nothing was changed\n")
        assert not (server.data / "backups").exists()
        in_copy = _rows(copy, "SELECT count(*) FROM traces_requesttrace")[0][0]
        # The copy holds every row written before the backup began (a copy of the file as
        # it was on disk, missing what the WAL held, would not); that it is one moment's
        # database, whole, is the prefix check below. (It cannot hold rows written after
        # it was taken, nor more rows than requests answered: those follow by themselves.)
        assert live_at_start <= in_copy
        assert _rows(copy, "PRAGMA integrity_check") == [("ok",)]

        server.process.terminate()  # type: ignore[union-attr]
        server.process.wait(timeout=30)  # type: ignore[union-attr]
        assert answered > answered_by_then  # requests went on after the copy
        server.commands(["user", "add", "late"])  # made after the backup: the restore drops it
        live_before = _rows(database, "SELECT count(*) FROM traces_requesttrace")[0][0]
        assert live_before > in_copy
        # One moment's database: the copy's rows are the live ones up to that moment, each
        # whole, none missing between them (a torn copy would differ or skip some).
        every = "SELECT * FROM traces_requesttrace ORDER BY id"
        assert _rows(copy, every) == _rows(database, every)[:in_copy]

        restored = _program(server, "restore", str(copy))
        assert restored.returncode == 0, restored.stderr
        kept = sorted((server.data / "backups").iterdir())
        assert [p.name.endswith("-before-restore.sqlite3") for p in kept] == [True]
        schema = len(_rows(copy, "SELECT id FROM django_migrations"))
        assert restored.stdout.splitlines() == [
            f"restored {database} from {copy} (schema {schema})",
            f"  the database it replaced is in {kept[0]}",
        ]
        assert _rows(database, "SELECT count(*) FROM traces_requesttrace") == [(in_copy,)]
        assert _rows(database, "SELECT username FROM auth_user WHERE username = 'late'") == []
        assert _rows(kept[0], "SELECT username FROM auth_user WHERE username = 'late'") == [
            ("late",)
        ]
        assert _rows(database, "PRAGMA integrity_check") == [("ok",)]
        # The restored data dir serves: the model answers again, to the key it had.
        key = server.key
        server.start()
        with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as client:
            reply = _chat(client, key)
        assert reply.status_code == 200, reply.text


# --- in this process: what is refused, and the copies kept in the data dir -----------------


@pytest.fixture
def sqlite_only() -> None:
    # `make test` runs this module on SQLite only (it is not in conftest.py's
    # DATABASE_MODULES): these tests copy the database's file.
    assert connection.vendor == "sqlite", "capyctl backup and restore copy SQLite's file"


def _database() -> Path:
    return Path(connection.settings_dict["NAME"])


def _dump() -> str:
    """The live database's content, read through SQLite. Never its file's bytes with a
    plain open(): closing any other descriptor of the file drops every POSIX lock this
    process holds on it (SQLite's own connections excepted, which share their locks), so
    another process (test_ledger's writers) could then take it for unused and delete its
    -wal and -shm files from under this process's connections: "disk I/O error", then
    "database disk image is malformed", in the tests after it."""
    with contextlib.closing(sqlite3.connect(f"file:{_database()}?mode=ro", uri=True)) as conn:
        return "\n".join(conn.iterdump())


def test_restore_refuses_what_is_not_a_capyctl_database_it_knows(cli, data_dir, sqlite_only):
    counts = table_counts()
    live = _dump()
    copy = data_dir / "copy.sqlite3"
    assert cli("backup", str(copy)).code == 0
    text = data_dir / "notes.txt"
    text.write_text("not a database\n")
    other = data_dir / "other.sqlite3"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    newer = data_dir / "newer.sqlite3"
    newer.write_bytes(copy.read_bytes())
    with sqlite3.connect(newer) as conn:
        conn.execute("INSERT INTO django_migrations (app, name, applied) "
                     "VALUES ('deployments', '9999_from_the_future', '2027-01-01')")  # fmt: skip
    torn = data_dir / "torn.sqlite3"
    torn.write_bytes(copy.read_bytes()[: len(copy.read_bytes()) // 2])

    for path, message in (
        (data_dir / "missing.sqlite3", f"{data_dir / 'missing.sqlite3'}: no such file"),
        (text, f"{text} is not a SQLite database (file is not a database): nothing was changed"),
        (other, (f"{other} is not a CapyCTL database (no CapyCTL migrations recorded in it): "
                 "nothing was changed")),
        (newer, (f"{newer} was made by a newer CapyCTL (its schema has "
                 "deployments.9999_from_the_future, which this version does not know): upgrade "
                 "CapyCTL first; nothing was changed")),
    ):  # fmt: skip
        refused = cli("restore", str(path))
        assert (refused.code, refused.out, refused.err) == (2, "", f"capyctl: error: {message}\n")
    refused = cli("restore", str(torn))
    assert refused.code == 2
    assert refused.err.startswith(f"capyctl: error: {torn} ")
    assert refused.err.endswith(": nothing was changed\n")
    assert len(refused.err.splitlines()) == 1
    assert table_counts() == counts
    assert _dump() == live
    assert not (data_dir / "backups").exists()


def test_backups_in_the_data_dir_are_private_and_the_newest_five_kept(cli, data_dir, sqlite_only):
    made = []
    for _ in range(7):
        done = cli("backup")
        assert done.code == 0, done.err
        made.append(Path(done.out.rstrip().rsplit(" to ", 1)[1]))
    kept = sorted((data_dir / "backups").iterdir())
    assert sorted(made[2:]) == kept
    for path in kept:
        assert path.name.startswith("capyctl-")
        assert "-schema" in path.name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert _rows(path, "PRAGMA journal_mode") == [("delete",)]  # one file, no -wal
    assert stat.S_IMODE((data_dir / "backups").stat().st_mode) == 0o700


def test_backup_to_a_file_never_overwrites_one(cli, data_dir, sqlite_only):
    taken = data_dir / "mine.sqlite3"
    taken.write_text("keep me\n")
    refused = cli("backup", str(taken))
    assert (refused.code, refused.err) == (
        2,
        f"capyctl: error: {taken} exists already: name a new file; nothing was written\n",
    )
    assert taken.read_text() == "keep me\n"
    nowhere = data_dir / "no-such-dir" / "x.sqlite3"
    refused = cli("backup", str(nowhere))
    assert refused.err == (
        f"capyctl: error: {nowhere.parent}: no such directory; nothing was written\n"
    )
    into_dir = cli("backup", str(data_dir))
    assert into_dir.code == 0
    assert Path(into_dir.out.rstrip().rsplit(" to ", 1)[1]).parent == data_dir


def test_on_postgresql_backup_and_restore_name_pg_dump_and_pg_restore(cli, monkeypatch):
    server = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "capyctl",
        "HOST": "db.internal",
        "PORT": 5432,
        "USER": "capy",
        "PASSWORD": "s3cret",
    }
    monkeypatch.setitem(django_settings.DATABASES, "default", server)
    backup = cli("backup")
    assert backup.code == 2
    assert backup.err == (
        "capyctl: error: capyctl cannot back up a PostgreSQL database: use `pg_dump "
        "--format=custom --file=capyctl.dump --host=db.internal --port=5432 --username=capy "
        "capyctl`\n"
    )
    restore = cli("restore", "capyctl.dump")
    assert restore.code == 2
    assert "use `pg_restore --clean --if-exists --dbname=NAME FILE`" in restore.err
    assert "s3cret" not in backup.err + restore.err


@pytest.mark.e2e
def test_restore_brings_back_a_backup_of_another_page_size(program_env, tmp_path):
    made = run_programs(program_env, ["user", "add", "bob"], ["backup", str(tmp_path / "b.db")])
    assert [r.code for r in made] == [0, 0], made
    with contextlib.closing(sqlite3.connect(tmp_path / "b.db")) as conn:  # an older SQLite's
        conn.execute("PRAGMA page_size=1024")
        conn.execute("VACUUM")
    assert run_programs(program_env, ["user", "add", "carol"])[0].code == 0

    restored = run_program(program_env, "restore", str(tmp_path / "b.db"))
    assert restored.code == 0, restored.err
    users = run_program(program_env, "user", "list")
    assert "bob" in users.out
    assert "carol" not in users.out
