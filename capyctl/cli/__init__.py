"""The ``capyctl`` command line.

Arguments are parsed before Django loads, so ``--data-dir`` and other start flags can
become ``CAPYCTL_*`` variables first. A user mistake prints one line,
``capyctl …: error: …``, and exits with status 2, having changed nothing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from capyctl.cli.parser import build_parser
from hostagent.datadir import PRIVATE_UMASK

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _fail(message: str, status: int) -> int:
    print(f"capyctl: error: {message}", file=sys.stderr)
    return status


def _setup_django() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")
    django.setup()


def _collect_garbage_again() -> None:
    """Turn the garbage collector back on once start-up is done (``main`` turns it off).

    What start-up made lives as long as the process, so it is frozen out of later
    collections instead of being scanned again and again.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if not getattr(args, "no_django", False) and importlib.util.find_spec("django") is None:
        return _fail(  # the slim install (capyctl-host): the host agent only
            "this install (capyctl-host) runs only the host agent, `capyctl start host`; the "
            "other commands need the full install: pip install capyctl",
            EXIT_USAGE,
        )
    if getattr(args, "demo", False):
        from capyctl.cli.demo import demo_environment

        refused = demo_environment(args)
        if refused is not None:
            return _fail(refused, EXIT_USAGE)
    missing = _missing_data_dir(args)
    if missing is not None:
        return _fail(missing, EXIT_USAGE)
    if getattr(args, "data_dir", None):
        os.environ["CAPYCTL_DATA_DIR"] = str(Path(args.data_dir).expanduser().resolve())
    if getattr(args, "run_mode", None):
        os.environ["CAPYCTL_MODE"] = args.run_mode

    if getattr(args, "no_django", False):  # the host agent: no database, no Django
        _collect_garbage_again()
        return int(args.handler(args) or 0)
    return _run_with_django(args)


def _missing_data_dir(args: argparse.Namespace) -> str | None:
    """Why a command may not run here: it would make a new data dir (with a new admin
    account, and none of the models) where none exists, only because it was typed in
    another directory. The start commands and ``capyctl init`` make one, as asked; so does
    any command given a data dir by name (``--data-dir``, ``CAPYCTL_DATA_DIR``)."""
    if getattr(args, "run_mode", None) or getattr(args, "no_django", False):
        return None
    if getattr(args, "makes_data_dir", False):
        return None
    if getattr(args, "data_dir", None) or os.environ.get("CAPYCTL_DATA_DIR", "").strip():
        return None
    path = Path.cwd() / ".capyctl"
    if path.is_dir():
        return None
    return (
        f"no data dir here ({path} does not exist): run capyctl where the server's data dir "
        "is, name it with --data-dir DIR or CAPYCTL_DATA_DIR, or make a new one with "
        "`capyctl init`"
    )


def _run_with_django(args: argparse.Namespace) -> int:
    from capyctl.conf import ConfigError

    try:
        _setup_django()
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    _collect_garbage_again()
    if getattr(args, "run_mode", None) and os.environ.get("CAPYCTL_LOG_LEVEL") != "DEBUG":
        # httpx logs each call at INFO: the engines' health checks and state polls, every
        # few seconds each, would bury the access lines (capyctl.access) of the requests.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if not getattr(args, "run_mode", None) and "CAPYCTL_LOG_LEVEL" not in os.environ:
        # Management commands print their own results; routine log lines would be noise.
        logging.getLogger().setLevel(logging.WARNING)
        # So would the log lines of the events a command records (a revoke's warnings): it
        # says what it did, and `capyctl events` lists them.
        logging.getLogger("capyctl.events").setLevel(logging.ERROR)

    from django.db import DatabaseError

    from capyctl.errors import UserError

    try:
        return int(args.handler(args) or 0)
    except UserError as exc:  # a mistake; or Redis not answering, which is not one
        outage = getattr(exc, "code", "") == "control_plane_unavailable"
        return _fail(str(exc), EXIT_FAILURE if outage else EXIT_USAGE)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except DatabaseError as exc:
        return _fail(_database_failure(exc), EXIT_FAILURE)


def _database_failure(exc: Exception) -> str:
    """One line for a database failure, with the cause in plain words where it is one a
    person can act on (nothing was changed: the transaction was rolled back)."""
    from django.conf import settings

    from capyctl.scheduler.errors import database_trouble

    db = settings.DATABASES["default"]
    where = str(db["NAME"])
    trouble = database_trouble(exc)
    if trouble == "disk full":
        return (
            f"the disk holding the database ({where}) is full: nothing was changed; free "
            "space and retry"
        )
    if trouble == "read-only":
        return f"the database ({where}) is on a read-only disk: nothing was changed"
    if trouble == "locked":
        waited = db.get("OPTIONS", {}).get("timeout")
        after = f" for {waited:g}s" if isinstance(waited, int | float) else ""
        return (
            f"the database ({where}) is locked by another program (waited{after}): nothing "
            "was changed; retry when it is done"
        )
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"database error: {first_line}"


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    # What the program writes (data dir, database, keys, engine logs) is its owner's only.
    os.umask(PRIVATE_UMASK)
    # Loading Django makes some hundred thousand objects and frees few: collecting while
    # it loads cost a listing a tenth of its time. Back on after start-up.
    gc.disable()
    try:
        status = run(argv)
        sys.stdout.flush()
    except KeyboardInterrupt:
        status = 130
    except BrokenPipeError:
        # Whoever read the output stopped (`capyctl events | head -1`): end quietly, as a
        # program that SIGPIPE killed, and leave nothing for the exit's flush to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 128 + signal.SIGPIPE
    sys.exit(status)


__all__ = ["main", "run"]
