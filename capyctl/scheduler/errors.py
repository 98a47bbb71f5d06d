"""What the scheduler answers when it cannot do what was asked.

Each class carries its OpenAI-style ``code``; the gateway maps classes to HTTP answers, so no
one parses messages.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from django.db import DatabaseError

from capyctl.errors import UserError


class SchedulerError(UserError):
    """An operation could not be done; ``code`` is the OpenAI-style error code."""

    code = "scheduler_error"


class NoCapacityError(SchedulerError):
    """No host has room, even after every allowed victim."""

    code = "no_capacity"

    def __init__(self, message: str, blockers: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.blockers = tuple(blockers)


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
