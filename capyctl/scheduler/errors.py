"""What the scheduler answers when it cannot do what was asked.

Each class carries its OpenAI-style ``code``; the gateway maps classes to HTTP answers, so no
one parses messages.
"""

from __future__ import annotations

from collections.abc import Iterable

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


_BY_CODE: dict[str, type[SchedulerError]] = {
    cls.code: cls
    for cls in (
        NoCapacityError,
        ModelStoppedError,
        EngineFailedError,
        SourceError,
        WakeTimeoutError,
        UnavailableError,
    )
}


def error_for(code: str, message: str) -> SchedulerError:
    """The typed error for a ``code`` told by another process (server mode's workers)."""
    return _BY_CODE.get(code, UnavailableError)(message)
