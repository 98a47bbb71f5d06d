"""Checks shared by every entry point; they raise :class:`UserError` naming the bad value."""

from __future__ import annotations

import re
import shlex
from datetime import UTC, datetime, timedelta

from capyctl.errors import UserError
from hostagent.units import SizeError, is_bare_number, parse_size, unit_hint

# Lowercase DNS label: what a deployment, engine or host may be called.
_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
# Aliases are what apps send as "model": allow the usual model-id characters too
# (``Qwen/Qwen2.5-7B-Instruct``, ``llama3.1:8b``), but no spaces or control characters.
_ALIAS_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._:/@+-]{0,126}[A-Za-z0-9])?$")
_DURATION_RE = re.compile(r"^(\d+)\s*([smhdw])$")
_ISO_START = re.compile(r"^\d{4}-\d\d-\d\d")  # a date first: an ISO time, not a duration
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def validate_name(value: str, *, what: str = "name", field: str = "name") -> str:
    """Return ``value`` if it is a lowercase DNS label (a-z, 0-9, '-', 1-63 characters)."""
    if not _NAME_RE.match(value):
        raise UserError(
            f"invalid {what} {value!r}: use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit",
            field=field,
        )
    return value


def validate_alias(value: str) -> str:
    if not _ALIAS_RE.match(value):
        raise UserError(
            f"invalid alias {value!r}: use up to 128 letters, digits and . _ : / @ + -, "
            "starting and ending with a letter or digit",
            field="aliases",
        )
    return value


MAX_SIZE_BYTES = 2**62  # 4 EiB: beyond any machine, within a 64-bit database column


def parse_size_value(value: str | int, *, field: str, bare_hint: str = "") -> int:
    """Bytes from ``24GiB`` or ``512MiB`` (text), or a byte count (an integer, as JSON
    sends it). Text without a unit is refused with what to write (and ``bare_hint``)."""
    if isinstance(value, str) and is_bare_number(value):
        raise UserError(
            f"invalid {field.replace('_', ' ')} {value!r}: {unit_hint(value)}{bare_hint}",
            field=field,
        )
    if isinstance(value, int):
        size = value
        if size <= 0:
            raise UserError(
                f"invalid {field.replace('_', ' ')} {value!r}: must be > 0", field=field
            )
    else:
        try:
            size = parse_size(value, unit_required=True)
        except SizeError as exc:
            raise UserError(f"invalid {field.replace('_', ' ')}: {exc}", field=field) from None
    if size > MAX_SIZE_BYTES:
        raise UserError(
            f"invalid {field.replace('_', ' ')} {value!r}: larger than 4 EiB", field=field
        )
    return size


def parse_gpu_memory(value: str | int) -> tuple[int | None, float | None]:
    """Parse ``--gpu-memory``: a size per GPU (``20GiB``; bytes as an integer from JSON)
    or a fraction of the device.

    A fraction is a number in (0, 1] written with a decimal point or a percent sign
    (``0.9``, ``1.0``, ``90%``). Returns ``(bytes, None)`` or ``(None, fraction)``.
    """
    if isinstance(value, int):
        return parse_size_value(value, field="gpu_memory"), None
    text = value.strip()
    number: float | None = None
    if text.endswith("%"):
        try:
            number = float(text[:-1]) / 100
        except ValueError:
            number = None
        if number is None:
            raise UserError(f"invalid gpu memory {value!r}: not a percentage", field="gpu_memory")
    elif re.fullmatch(r"\d*\.\d+|\d+\.\d*", text):
        number = float(text)
    if number is not None:
        if number > 1 and not text.endswith("%"):
            raise UserError(
                f"invalid gpu memory {value!r}: a fraction must lie in (0, 1]; "
                f"for a size write {text}GiB",
                field="gpu_memory",
            )
        if not 0 < number <= 1:
            raise UserError(
                f"invalid gpu memory fraction {value!r}: a fraction must lie in (0, 1]",
                field="gpu_memory",
            )
        return None, number
    also = " (or 1.0 for all of it)" if text == "1" else ""
    return parse_size_value(text, field="gpu_memory", bare_hint=also), None


def parse_duration(value: str, *, field: str) -> timedelta:
    """``30d``, ``12h``, ``45m``, ``90s``, ``2w`` → a timedelta."""
    match = _DURATION_RE.match(value.strip())
    if match is None or int(match[1]) <= 0:
        raise UserError(
            f"invalid {field} {value!r}: use a number and a unit, like 30d, 12h, 45m or 2w",
            field=field,
        )
    seconds = int(match[1]) * _DURATION_UNITS[match[2]]
    if seconds > 100 * 365 * 86400:
        raise UserError(f"invalid {field} {value!r}: at most 100 years", field=field)
    return timedelta(seconds=seconds)


def parse_moment(value: str, *, field: str, now: datetime) -> datetime:
    """A point in time: an ISO time (``2026-12-01T08:00Z``; UTC when it names no zone) or
    a duration before ``now`` (``24h``, ``30m``, ``7d``: :func:`parse_duration`)."""
    text = value.strip()
    if _ISO_START.match(text):
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    elif _DURATION_RE.match(text):
        return now - parse_duration(text, field=field)
    raise UserError(
        f"invalid {field} {value!r}: use a duration before now (24h, 30m, 7d) or an ISO "
        "time (2026-12-01T08:00Z)",
        field=field,
    )


def split_engine_args(value: str) -> list[str]:
    """Split ``--args`` the way a shell would, without running one."""
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise UserError(f"invalid engine args {value!r}: {exc}", field="engine_args") from None
