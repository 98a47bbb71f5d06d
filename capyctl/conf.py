"""Typed readers for ``CAPYCTL_*`` environment variables.

Each reader refuses a bad value with :class:`ConfigError`, whose message names the
variable and what it expects, so start-up stops with one clear line.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from hostagent.units import SizeError, parse_size

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(Exception):
    """A configuration value is wrong; the message says which and why."""


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    value = env.get(name)
    return None if value is None else value.strip()


def env_str(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    value = _raw(name, environ)
    return default if value is None or value == "" else value


def env_optional_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    value = _raw(name, environ)
    return value or None


def env_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    value = _raw(name, environ)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean (use true/false, 1/0, yes/no)")


def env_int(
    name: str,
    default: int,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    value = _raw(name, environ)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name}={value!r} must be at least {minimum}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name}={value!r} must be at most {maximum}")
    return number


def env_float(
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> float:
    value = _raw(name, environ)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise ConfigError(f"{name}={value!r} is not a finite number")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name}={value!r} must be at least {minimum}")
    return number


def env_size(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    value = _raw(name, environ)
    if value is None or value == "":
        return default
    if value == "0":
        return 0
    try:
        return parse_size(value)
    except SizeError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def env_choice(
    name: str, default: str, choices: tuple[str, ...], environ: Mapping[str, str] | None = None
) -> str:
    value = _raw(name, environ)
    if value is None or value == "":
        return default
    if value not in choices:
        raise ConfigError(f"{name}={value!r} must be one of: {', '.join(choices)}")
    return value


def env_path(name: str, default: Path, environ: Mapping[str, str] | None = None) -> Path:
    value = _raw(name, environ)
    path = Path(value) if value else default
    return path.expanduser().resolve()


def env_list(name: str, default: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    value = _raw(name, environ)
    if value is None or value == "":
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


_SIM_GPUS_RE = re.compile(r"^(?:(?P<count>\d+)x)?(?P<size>[0-9.]+\s?[A-Za-z]*)$")


def parse_sim_gpus(name: str, value: str | None) -> tuple[str, list[int]] | None:
    """Parse ``CAPYCTL_SIM_GPUS``: ``24GiB``, ``2x80GiB``, ``24GiB,48GiB`` or ``unified:128GiB``.

    Returns ``("discrete", [bytes per GPU...])`` or ``("unified", [bytes])``, or ``None``
    when unset.
    """
    if value is None or value.strip() == "":
        return None
    text = value.strip()
    if text.startswith("unified:"):
        try:
            return ("unified", [parse_size(text.removeprefix("unified:"))])
        except SizeError as exc:
            raise ConfigError(f"{name}={value!r}: {exc}") from None
    sizes: list[int] = []
    for part in text.split(","):
        match = _SIM_GPUS_RE.match(part.strip())
        if match is None:
            raise ConfigError(
                f"{name}={value!r} is not a GPU list (examples: 24GiB, 2x80GiB, unified:128GiB)"
            )
        count = int(match["count"] or 1)
        if not 1 <= count <= 64:
            raise ConfigError(f"{name}={value!r}: a GPU count must lie between 1 and 64")
        try:
            size = parse_size(match["size"])
        except SizeError as exc:
            raise ConfigError(f"{name}={value!r}: {exc}") from None
        sizes.extend([size] * count)
    return ("discrete", sizes)
