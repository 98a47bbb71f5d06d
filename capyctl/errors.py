"""Errors that every entry point (CLI, REST, admin) shows to the user as one line."""

from __future__ import annotations


class UserError(Exception):
    """Something the user asked for is wrong; nothing was changed.

    ``field`` names the input at fault (``"name"``, ``"gpu_memory"``…) so REST and the
    admin can attach the message to the right field.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class NotFoundError(UserError):
    """The named object does not exist."""
