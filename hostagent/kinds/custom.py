"""A custom OpenAI-compatible server, described by a command template.

The template names where CapyCTL's values go: ``{port}`` (required), ``{api_key}``,
``{model}``, ``{source}``, ``{host}``. It is split with shlex and run without a shell, so
a value can never become a second command.
"""

from __future__ import annotations

import string

from hostagent.kinds.base import KindError, split_command

PLACEHOLDERS = frozenset({"port", "api_key", "model", "source", "host"})


class CustomKind:
    name = "custom"
    description = "any OpenAI-compatible server, from a command template"
    can_park_ram = False
    can_park_deep = False

    def check_args(self, args: list[str]) -> None:
        # A custom template decides its own flags; extra args are appended as given.
        return None

    def check_command(self, command: str) -> list[str]:
        argv = split_command(command)
        used: set[str] = set()
        for arg in argv:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(arg) if f is not None]
            except ValueError as exc:
                raise KindError(f"invalid command template {command!r}: {exc}") from None
            for field in fields:
                if field not in PLACEHOLDERS:
                    known = ", ".join("{" + p + "}" for p in sorted(PLACEHOLDERS))
                    raise KindError(
                        f"invalid command template {command!r}: unknown placeholder "
                        f"{{{field}}} (known: {known})"
                    )
                used.add(field)
        if "port" not in used:
            raise KindError(
                f"invalid command template {command!r}: it must contain {{port}} so the "
                "server listens where CapyCTL expects"
            )
        return argv
