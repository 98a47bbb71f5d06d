"""Byte sizes as people write them (``24GiB``, ``512MiB``, ``1.5GB``, ``1073741824``)."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "ki": 1024,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mi": 1024**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gi": 1024**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ti": 1024**4,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s?(?P<unit>[A-Za-z]*)$")
_BARE_RE = re.compile(r"^\d+(?:\.\d+)?$")
# Exact spellings, largest first: a stored size shown so that parsing it gives it back.
_EXACT = (("TiB", 1024**4), ("TB", 1000**4), ("GiB", 1024**3), ("GB", 1000**3),
          ("MiB", 1024**2), ("MB", 1000**2), ("KiB", 1024), ("KB", 1000))  # fmt: skip


class SizeError(ValueError):
    """A size string that does not parse; the message names the bad value."""


def parse_size(text: str, *, unit_required: bool = False) -> int:
    """Return the number of bytes ``text`` names.

    Accepts a plain integer of bytes or a number with a unit: ``B``, ``KiB``/``MiB``/
    ``GiB``/``TiB`` (powers of 1024; ``Ki``, ``Mi``… too) or ``KB``/``MB``/``GB``/``TB``
    (powers of 1000; ``K``, ``M``… too). Units are case-insensitive. Fractions of a byte
    and zero are refused; with ``unit_required``, so is a number without a unit (what
    people type: is ``16`` bytes, or GiB?), with what to write instead.
    """
    if unit_required and is_bare_number(text):
        raise SizeError(f"invalid size {text!r}: {unit_hint(text)}")
    match = _SIZE_RE.match(text.strip())
    if match is None:
        use = "a number" if unit_required else "bytes or a number"
        raise SizeError(f"invalid size {text!r}: use {use} with a unit like 24GiB")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise SizeError(f"invalid size {text!r}: unknown unit {match['unit']!r}")
    number = float(match["number"])
    value = number * _UNITS[unit]
    if value != int(value):
        raise SizeError(f"invalid size {text!r}: not a whole number of bytes")
    if value <= 0:
        raise SizeError(f"invalid size {text!r}: must be more than 0 bytes")
    return int(value)


def is_bare_number(text: str) -> bool:
    """Whether ``text`` is a number without a unit (``16``, ``1.5``)."""
    return _BARE_RE.match(text.strip()) is not None


def is_unit(word: str) -> bool:
    """Whether ``word`` is a size unit on its own (``GB``, ``GiB``, ``m``)."""
    return bool(word) and word.lower() in _UNITS


def unit_hint(text: str) -> str:
    """What to write instead of a number without a unit."""
    return f"a size needs a unit: write {text.strip()}GiB"


def format_size_exact(num_bytes: int) -> str:
    """A size as :func:`parse_size` reads it back to the byte: ``16GB``, ``20GiB``,
    ``1536MiB``, ``1000001B``."""
    for unit, factor in _EXACT:
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


def format_size(num_bytes: int | None) -> str:
    """Show bytes the way people read them: ``24.0 GiB``, ``512.0 MiB``, ``100 B``."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
