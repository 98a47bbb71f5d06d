"""A trace file, read and checked: JSON Lines, one request a line (docs/what-if.md).

Only ``at`` and ``model`` are needed. ``at`` is an ISO-8601 time (``2026-12-02T01:02:03.456Z``)
or a number of seconds (from any origin: the first request is time 0). A request's time in
its engine is its ``duration_ms`` less its ``queued_ms`` when both are there (an answer
that was served: ``status`` 200 or none given), else the model's service timing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from capyctl.errors import UserError
from capyctl.whatif.model import Request

MAX_LINE_BYTES = 64 * 1024


def read_trace(path: str) -> list[Request]:
    """The requests of the trace file at ``path`` (``-``: standard input), oldest first."""
    if path == "-":
        import sys  # noqa: PLC0415

        return parse_lines(sys.stdin, "<stdin>")
    file = Path(path)
    try:
        with file.open("rb") as handle:
            return parse_lines((raw.decode("utf-8", "replace") for raw in handle), path)
    except FileNotFoundError:
        raise UserError(f"trace {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"trace {path}: is a directory, not a trace file") from None
    except PermissionError:
        raise UserError(f"trace {path}: not readable") from None


def parse_lines(lines: Iterable[str], where: str) -> list[Request]:
    found: list[tuple[float, Request]] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if len(text) > MAX_LINE_BYTES:
            raise UserError(f"trace {where} line {number}: longer than 64 KiB")
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            raise UserError(f"trace {where} line {number}: not a JSON object") from None
        if not isinstance(row, dict):
            raise UserError(f"trace {where} line {number}: not a JSON object")
        found.append(_request(row, f"trace {where} line {number}"))
    if not found:
        raise UserError(f"trace {where}: no requests in it")
    found.sort(key=lambda item: item[0])
    origin = found[0][0]
    requests = []
    for at, request in found:
        request.at = at - origin
        requests.append(request)
    return requests


def _request(row: dict[str, Any], where: str) -> tuple[float, Request]:
    at = _time(row.get("at"), where)
    model = row.get("model")
    if not isinstance(model, str) or not model or len(model) > 128:
        raise UserError(f"{where}: `model` must be a model's name")
    service = None
    duration, queued = row.get("duration_ms"), row.get("queued_ms")
    if row.get("status") in (None, 200) and _number(duration) and _number(queued or 0):
        service = max(float(duration or 0) - float(queued or 0), 0.0) / 1000
    key = row.get("key")
    return at, Request(0.0, model, service, key if isinstance(key, int) else None,
                       row.get("stream") is True)  # fmt: skip


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _time(value: Any, where: str) -> float:
    if _number(value):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            pass
    raise UserError(f"{where}: `at` must be an ISO-8601 time or a number of seconds")
