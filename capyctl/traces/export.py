"""Traces as JSON Lines, the format the what-if simulator replays (docs/what-if.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime

from capyctl.traces.models import RequestTrace

# The contract: a line's keys, in this order.
FIELDS = ("at", "model", "key", "stream", "status", "code", "queued_ms", "ttfb_ms",
          "duration_ms", "prompt_tokens", "completion_tokens", "switch")  # fmt: skip
_COLUMNS = ("at", "model", "key_pk", "stream", "status", "code", "queued_ms", "ttfb_ms",
            "duration_ms", "prompt_tokens", "completion_tokens", "switch")  # fmt: skip
CHUNK_ROWS = 2000  # rows fetched at a time: the table is never read into memory whole


def format_at(at: datetime) -> str:
    """``2026-12-02T01:02:03.456Z``: UTC, to the millisecond."""
    at = at.astimezone(UTC)
    return f"{at:%Y-%m-%dT%H:%M:%S}.{at.microsecond // 1000:03d}Z"


def trace_lines(
    *, since: datetime | None = None, until: datetime | None = None, model: str | None = None
) -> Iterator[str]:
    """One JSON object per recorded request that arrived from ``since`` (inclusive) to
    ``until`` (exclusive), for ``model`` alone if given; oldest first, without newlines."""
    rows = RequestTrace.objects.all()
    if since is not None:
        rows = rows.filter(at__gte=since)
    if until is not None:
        rows = rows.filter(at__lt=until)
    if model is not None:
        rows = rows.filter(model=model)
    for row in rows.order_by("at", "id").values_list(*_COLUMNS).iterator(chunk_size=CHUNK_ROWS):
        line = dict(zip(FIELDS, row, strict=True))
        line["at"] = format_at(row[0])
        line["code"] = row[5] or None
        yield json.dumps(line)
