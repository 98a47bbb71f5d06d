"""The contract every engine kind satisfies."""

from __future__ import annotations

import shlex
from typing import Protocol


class KindError(ValueError):
    """A kind cannot do what was asked, or was given something it cannot use."""


class EngineKind(Protocol):
    """What CapyCTL knows about one engine program.

    ``can_park_ram``: the engine can copy its weights to host RAM and give the GPU back
    while it keeps running. ``can_park_deep``: it can drop its weights and reload them on
    wake. A kind that can do neither is stopped to make room and started again on demand.
    """

    name: str
    description: str
    can_park_ram: bool
    can_park_deep: bool

    def check_command(self, command: str) -> list[str]:
        """Split ``command`` into an argument list, or raise :class:`KindError`."""
        ...

    def check_args(self, args: list[str]) -> None:
        """Refuse extra engine arguments that would override what CapyCTL sets itself."""
        ...


def split_command(command: str) -> list[str]:
    """Split a command line the way a POSIX shell would, without ever running a shell."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise KindError(f"invalid command {command!r}: {exc}") from None
    if not argv:
        raise KindError("invalid command: it is empty")
    return argv


# Flags CapyCTL sets on every launch: the loopback address, its port and the launch key.
RESERVED_FLAGS = ("--host", "--port", "--api-key")


def check_reserved_flags(kind: str, args: list[str], reserved: tuple[str, ...]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in reserved:
            raise KindError(
                f"engine args may not set {flag}: CapyCTL sets it for every {kind} launch "
                "(engines listen on 127.0.0.1 only, on a port and key CapyCTL picks)"
            )


class ProgramKind:
    """Shared behaviour of kinds whose command is a program path plus fixed arguments."""

    name = ""
    description = ""
    can_park_ram = False
    can_park_deep = False
    reserved_flags: tuple[str, ...] = RESERVED_FLAGS

    def check_args(self, args: list[str]) -> None:
        check_reserved_flags(self.name, args, self.reserved_flags)

    def check_command(self, command: str) -> list[str]:
        argv = split_command(command)
        if any("{" in arg and "}" in arg for arg in argv):
            raise KindError(
                f"invalid command {command!r}: placeholders like {{port}} belong to the "
                f"'custom' kind; {self.name} gets its flags from CapyCTL"
            )
        return argv
