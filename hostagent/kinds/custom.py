"""A custom OpenAI-compatible server, described by a command template and options.

The template says where CapyCTL's values go: ``{host}`` and ``{port}`` (both required:
the server must listen on loopback, where CapyCTL expects it), ``{api_key}``, ``{model}``,
``{source}``. It is split with shlex and each argument is filled
in separately, so a value can never become a second argument or command.

Options (all optional)::

    {"health_path": "/health",
     "warm_up": false,
     "park": {"ram": HOOK, "deep": HOOK},
     "wake": {"ram": HOOK, "deep": HOOK}}

where ``HOOK`` is ``{"method": "POST", "path": "/sleep", "json": {...}}``. A park mode is
offered only when both its park and wake hooks are given.
"""

from __future__ import annotations

import string
from typing import Any

from hostagent.errors import CannotParkError
from hostagent.kinds.base import (
    LOOPBACK,
    Capabilities,
    EngineClient,
    KindError,
    Launch,
    LaunchSpec,
    gpu_env,
    one_token_completion,
    split_command,
)

PLACEHOLDERS = frozenset({"port", "api_key", "model", "source", "host"})
_OPTION_KEYS = frozenset({"health_path", "warm_up", "park", "wake"})
_HOOK_KEYS = frozenset({"method", "path", "json"})
_MODES = ("ram", "deep")


def _fields(arg: str, command: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(arg) if f is not None]
    except ValueError as exc:
        raise KindError(f"invalid command template {command!r}: {exc}") from None


def _check_hook(where: str, hook: Any) -> None:
    if not isinstance(hook, dict) or not isinstance(hook.get("path"), str):
        raise KindError(f"option {where} must be an object with a 'path'")
    unknown = set(hook) - _HOOK_KEYS
    if unknown:
        raise KindError(f"option {where} has unknown keys: {', '.join(sorted(unknown))}")
    if not hook["path"].startswith("/"):
        raise KindError(f"option {where}.path must start with '/'")
    if str(hook.get("method", "POST")).upper() not in ("GET", "POST", "PUT"):
        raise KindError(f"option {where}.method must be GET, POST or PUT")


class CustomKind:
    name = "custom"
    description = "any OpenAI-compatible server, from a command template"

    def capabilities(self, options: dict[str, Any]) -> Capabilities:
        park = options.get("park") or {}
        wake = options.get("wake") or {}
        return Capabilities(
            ram="ram" in park and "ram" in wake, deep="deep" in park and "deep" in wake
        )

    def check_command(self, command: str) -> list[str]:
        argv = split_command(command)
        used: set[str] = set()
        for arg in argv:
            for field in _fields(arg, command):
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
        if "host" not in used:
            raise KindError(
                f"invalid command template {command!r}: it must contain {{host}} so the "
                f"server listens on {LOOPBACK} only"
            )
        return argv

    def check_args(self, args: list[str]) -> None:
        # A custom template decides its own flags; extra args are appended as given.
        return None

    def check_options(self, options: dict[str, Any]) -> None:
        unknown = set(options) - _OPTION_KEYS
        if unknown:
            raise KindError(f"unknown custom engine options: {', '.join(sorted(unknown))}")
        health = options.get("health_path", "/health")
        if not isinstance(health, str) or not health.startswith("/"):
            raise KindError("option health_path must be a path starting with '/'")
        for group in ("park", "wake"):
            hooks = options.get(group) or {}
            if not isinstance(hooks, dict) or set(hooks) - set(_MODES):
                raise KindError(f"option {group} must map 'ram' and/or 'deep' to a hook")
            for mode, hook in hooks.items():
                _check_hook(f"{group}.{mode}", hook)

    def build_launch(self, spec: LaunchSpec) -> Launch:
        self.check_command(spec.command)
        values = {
            "port": str(spec.port),
            "api_key": spec.api_key,
            "model": spec.served_name,
            "source": spec.source,
            "host": LOOPBACK,
        }
        argv = [arg.format(**values) for arg in split_command(spec.command)]
        return Launch(argv=[*argv, *spec.extra_args], env=gpu_env(spec))

    def is_healthy(self, client: EngineClient, spec: LaunchSpec) -> bool:
        return client.healthy(str(spec.options.get("health_path", "/health")))

    def warm_up(self, client: EngineClient, spec: LaunchSpec) -> None:
        if spec.options.get("warm_up"):
            one_token_completion(client, spec)

    def _call(self, client: EngineClient, spec: LaunchSpec, group: str, mode: str) -> None:
        capabilities = self.capabilities(spec.options)
        if not getattr(capabilities, mode, False):
            raise CannotParkError(
                f"this custom engine has no park and wake hooks for {mode!r} in its options"
            )
        hook = spec.options[group][mode]
        client.request(str(hook.get("method", "POST")).upper(), hook["path"], json=hook.get("json"))

    def park(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        self._call(client, spec, "park", mode)

    def wake(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        self._call(client, spec, "wake", mode)
