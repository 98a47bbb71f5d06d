"""What the scheduler answers when it cannot do what was asked.

Each class carries its OpenAI-style ``code``; the gateway maps classes to HTTP answers, so no
one parses messages.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import DatabaseError

from capyctl.errors import UserError


class SchedulerError(UserError):
    """An operation could not be done; ``code`` is the OpenAI-style error code."""

    code = "scheduler_error"


class NoCapacityError(SchedulerError):
    """No host has room, even after every allowed victim. ``lasting``: not even with every
    unpinned model parked or stopped (refused at once); else what is in the way will pass,
    and a request waits for it within its wake timeout."""

    code = "no_capacity"

    def __init__(self, message: str, blockers: Iterable[str] = (), *, lasting: bool = True) -> None:
        super().__init__(message)
        self.blockers = tuple(blockers)
        self.lasting = lasting


class ModelStoppedError(SchedulerError):
    """Its desired state is stopped: nothing starts it but a person."""

    code = "model_stopped"


class EngineFailedError(SchedulerError):
    """The engine failed to start, park or wake."""

    code = "engine_failed"


class SourceError(SchedulerError):
    """The deployment's weights are missing on its host, or their download failed."""

    code = "source_failed"


class WakeTimeoutError(SchedulerError):
    """It did not become ready within its wake timeout."""

    code = "wake_timeout"


class UnavailableError(SchedulerError):
    """The wake could not be done now (a switch gave up; the control plane did not
    answer); a retry may succeed."""

    code = "unavailable"


class ControlPlaneUnavailableError(UnavailableError):
    """Redis (or the database) did not answer, or cannot be trusted yet: nothing was
    switched; a retry once it is back succeeds."""

    code = "control_plane_unavailable"


_BY_CODE: dict[str, type[SchedulerError]] = {
    cls.code: cls
    for cls in (
        NoCapacityError,
        ModelStoppedError,
        EngineFailedError,
        SourceError,
        WakeTimeoutError,
        UnavailableError,
        ControlPlaneUnavailableError,
    )
}


def error_for(code: str, message: str) -> SchedulerError:
    """The typed error for a ``code`` told by another process (server mode's workers)."""
    return _BY_CODE.get(code, UnavailableError)(message)


def is_control_plane_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the database, Redis or the Celery broker not answering."""
    redis = sys.modules.get("redis")
    kombu = sys.modules.get("kombu.exceptions")
    return (
        isinstance(exc, DatabaseError)
        or (redis is not None and isinstance(exc, redis.exceptions.RedisError))
        or (kombu is not None and isinstance(exc, kombu.OperationalError))
        or isinstance(exc, ConnectionError)  # a socket refused or reset on the way
    )


@dataclass(frozen=True)
class Outage:
    """What a client is told about a control-plane failure (no address, no path) and how
    long it is asked to wait before trying again."""

    message: str
    retry_after: int


# What SQLite (and PostgreSQL) say when the database cannot be written, as plain causes.
# Matched on the driver's message: sqlite3 gives one class for all of them.
_DISK_FULL = ("database or disk is full", "no space left on device", "disk full")
_LOCKED = ("database is locked", "database table is locked")
_READ_ONLY = ("readonly database", "read-only file system", "read-only transaction")


def database_trouble(exc: BaseException) -> str | None:
    """``"disk full"``, ``"locked"`` or ``"read-only"`` when ``exc`` says the database
    cannot be written for that reason; None for anything else."""
    if not isinstance(exc, DatabaseError):
        return None
    text = str(exc).lower()
    for trouble, signs in (("disk full", _DISK_FULL), ("locked", _LOCKED),
                           ("read-only", _READ_ONLY)):  # fmt: skip
        if any(sign in text for sign in signs):
            return trouble
    return None


def outage(exc: BaseException) -> Outage:
    """The client's answer for ``exc``, a control-plane failure: a full or read-only disk
    does not pass by itself (someone must act), a lock or a lost connection soon does."""
    trouble = database_trouble(exc)
    if trouble == "disk full":
        return Outage("CapyCTL's database cannot be written: its disk is full.", 10)
    if trouble == "read-only":
        return Outage("CapyCTL's database cannot be written: its disk is read-only.", 10)
    if trouble == "locked":
        return Outage("CapyCTL's database is locked by another program; retry shortly.", 1)
    return Outage("CapyCTL's database or Redis did not answer; retry shortly.", 1)
