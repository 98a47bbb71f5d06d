"""bench/switch.py runs: its rounds on one tree's code, and REV's and the working tree's
alternating (a ``git worktree`` of REV, removed after)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_switch_bench_alternates_old_and_new_code_and_cleans_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    done = subprocess.run(
        [sys.executable, "bench/switch.py", "--rounds", "2", "--against", "HEAD"],
        capture_output=True, text=True, timeout=240, check=False, cwd=ROOT,
        env={**env, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("switch to a parked model, 2 rounds (standalone")
    header = next(line for line in lines if "new/old" in line)
    assert "old (" in header
    assert "new (working tree)" in header
    figures = {line.split("  ")[1].strip(): line for line in lines if " ms (" in line}
    assert {"request -> first byte", "CapyCTL's own share", "engine: wake call"} <= set(figures)
    assert sum(line.startswith("  target: CapyCTL's own share") for line in lines) == 2
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    assert str(tmp_path) not in worktrees
