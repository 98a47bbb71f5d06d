"""Typed readers for ``CAPYCTL_*`` environment variables.

Each reader refuses a bad value with :class:`ConfigError`, whose message names the
variable and what it expects, so start-up stops with one clear line.
"""

from __future__ import annotations

import ipaddress
import math
import os
import urllib.parse
import zoneinfo
from collections.abc import Mapping
from pathlib import Path

from hostagent.simgpu import SimSpec
from hostagent.simgpu import parse_sim_gpus as _parse_sim_gpus
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


def env_time_zone(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    """An IANA time zone's name (``Europe/Paris``), checked against the zone database."""
    value = _raw(name, environ) or default
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"{name}={value[:64]!r} is no time zone (an IANA name, such as Europe/Paris)"
        ) from None
    return value


def env_url(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """An http(s) URL with a host, or None when unset."""
    value = _raw(name, environ)
    if not value:
        return None
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name} must be an http:// or https:// URL with a host")
    return value


def env_networks(
    name: str, environ: Mapping[str, str] | None = None
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated addresses or networks (``10.0.0.5``, ``10.0.0.0/24``, ``fd00::/8``);
    empty: none."""
    networks = []
    for item in env_list(name, [], environ):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(f"{name}: {item!r} is not an address or network") from None
    return tuple(networks)


def env_secret(
    name: str, *, min_length: int, environ: Mapping[str, str] | None = None
) -> str | None:
    """A secret such as a bearer token, or ``None`` when unset; a short one is refused
    (the message names the variable, never the value)."""
    value = _raw(name, environ)
    if not value:
        return None
    if len(value) < min_length:
        raise ConfigError(f"{name} must be at least {min_length} characters long")
    return value


def parse_sim_gpus(name: str, value: str | None, pids: str = "own") -> SimSpec | None:
    """Parse ``CAPYCTL_SIM_GPUS`` (``24GiB``, ``2x80GiB``, ``unified:128GiB``), or ``None``;
    ``pids`` (``CAPYCTL_SIM_PIDS``, read by :func:`env_choice`) is how the simulated probe
    lists the engines' processes."""
    if value is None or value.strip() == "":
        return None
    try:
        return _parse_sim_gpus(value, pids)
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r}: {exc}") from None
