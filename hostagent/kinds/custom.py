"""A custom OpenAI-compatible server, described by a command template and options.

The template says where CapyCTL's values go: ``{host}`` and ``{port}`` (both required:
the server must listen on loopback, where CapyCTL expects it), ``{api_key_file}`` (the
path of a 0600 file holding the launch key, one line), ``{model}``, ``{source}``. It is
split with shlex and each argument is filled in separately, so a value can never become a
second argument or command. ``{api_key}`` is refused: every local user can read a command
line (``ps``); the key goes in the file, or in the variable the option ``api_key_env``
names.

Options (all optional)::

    {"health_path": "/health",
     "api_key_env": "MY_SERVER_API_KEY",
     "warm_up": false,
     "park": {"ram": HOOK, "deep": HOOK},
     "wake": {"ram": HOOK, "deep": HOOK}}

where ``HOOK`` is ``{"method": "POST", "path": "/sleep", "json": {...}}``. A park mode is
offered only when both its park and wake hooks are given.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

from hostagent.errors import AdapterError, CannotParkError
from hostagent.kinds.base import (
    Capabilities,
    KindError,
    Launch,
    LaunchSpec,
    check_adapter_spec,
    gpu_env,
    key_file_path,
    one_token_completion,
    split_command,
)
from hostagent.kinds.client import LOOPBACK, EngineClient
from hostagent.versions import EngineFeatures, ProbeCommands

PLACEHOLDERS = frozenset({"port", "api_key_file", "model", "source", "host"})
KEY_FILE = "api-key"
_OPTION_KEYS = frozenset({"health_path", "api_key_env", "warm_up", "park", "wake"})
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
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
    probes: ProbeCommands | None = None  # a template's program has no known way to say

    def capabilities(
        self, options: dict[str, Any], features: EngineFeatures | None = None
    ) -> Capabilities:
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
                if field == "api_key":
                    raise KindError(
                        f"invalid command template {command!r}: {{api_key}} would put the "
                        "launch key on the command line, which every local user can read; "
                        "use {api_key_file} (a 0600 file holding the key) or the option "
                        "api_key_env (a variable the server reads it from)"
                    )
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
        variable = options.get("api_key_env")
        if variable is not None and (
            not isinstance(variable, str) or not _VARIABLE.fullmatch(variable)
        ):
            raise KindError("option api_key_env must be an environment variable name")
        for group in ("park", "wake"):
            hooks = options.get(group) or {}
            if not isinstance(hooks, dict) or set(hooks) - set(_MODES):
                raise KindError(f"option {group} must map 'ram' and/or 'deep' to a hook")
            for mode, hook in hooks.items():
                _check_hook(f"{group}.{mode}", hook)

    def build_launch(self, spec: LaunchSpec) -> Launch:
        check_adapter_spec(self.name, spec, ())  # a template's server: no adapters known
        template = self.check_command(spec.command)
        values = {
            "port": str(spec.port),
            "model": spec.served_name,
            "source": spec.source,
            "host": LOOPBACK,
        }
        files: dict[Path, str] = {}
        if any("api_key_file" in _fields(arg, spec.command) for arg in template):
            path = key_file_path(spec, KEY_FILE)
            values["api_key_file"] = str(path)
            files[path] = spec.api_key + "\n"
        env = gpu_env(spec)
        if spec.options.get("api_key_env"):
            env[str(spec.options["api_key_env"])] = spec.api_key
        argv = [arg.format(**values) for arg in template]
        return Launch(argv=[*argv, *spec.extra_args], env=env, files=files)

    def socket_listening(self, features: EngineFeatures | None) -> bool:
        return False  # a template names {host} and {port}: it listens on TCP

    def asleep(self, client: EngineClient, spec: LaunchSpec) -> bool | None:
        return None

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

    def load_adapter(self, client: EngineClient, spec: LaunchSpec, name: str, path: str) -> None:
        raise AdapterError("custom cannot serve LoRA adapters")

    def unload_adapter(self, client: EngineClient, spec: LaunchSpec, name: str) -> None:
        raise AdapterError("custom cannot serve LoRA adapters")

    def loaded_adapters(self, client: EngineClient, spec: LaunchSpec) -> list[str] | None:
        return None
