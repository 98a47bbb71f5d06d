"""An engine's run directory: a 0700 folder of its own for the files its launch needs (the
key file of engines that read their key from one), made before the start, removed at stop."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def prepare_run_dir(run_dir: Path, files: dict[Path, str]) -> None:
    """Make ``run_dir`` afresh (0700) and write each of ``files`` in it, 0600 from the start
    (created with that mode, never widened: there is no moment another user could read it)."""
    remove_run_dir(run_dir)  # what a crashed engine of the same instance left
    run_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.mkdir(mode=0o700)
    for path, text in files.items():
        if path.parent != run_dir:
            raise ValueError(f"{path} is not in the run directory {run_dir}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)


def remove_run_dir(run_dir: Path) -> None:
    """Remove ``run_dir`` and what is in it, if it is there."""
    shutil.rmtree(run_dir, ignore_errors=True)
