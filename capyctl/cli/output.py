"""Printing listings as aligned tables or JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, empty: str) -> None:
    """Print an aligned table, or ``empty`` when there are no rows."""
    if not rows:
        print(empty)
        return
    cells = [[("-" if c is None or c == "" else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    print("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
