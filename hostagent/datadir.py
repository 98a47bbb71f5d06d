"""Data dirs hold secrets (keys, the database, launch keys), so they are their owner's only.

``capyctl`` runs with umask 077: every folder it makes is 0700 and every file 0600. A data
dir made some other way (by hand, or by an older version) is never changed behind its
owner's back; a start points it out in one line instead.
"""

from __future__ import annotations

import stat
from pathlib import Path

PRIVATE_UMASK = 0o077


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) as 0700 if it does not exist yet."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def open_to_others(path: Path) -> str | None:
    """A one-line warning when ``path`` exists and its group or others may use it."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (
        f"capyctl: warning: the data dir {path} is open to others (mode {mode:04o}), yet it "
        f"holds secrets; make it private with: chmod 700 {path}"
    )
