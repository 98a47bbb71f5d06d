"""bench/walk.py on the working tree: the modules a wake and an idle park pass through,
in order, with their counts."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_walk_of_a_wake_starts_at_the_gateway_api_and_reaches_the_driver(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    done = subprocess.run(
        [sys.executable, "bench/walk.py"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        env={**env, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = done.stdout.split("\n\n")
    wake = next(b for b in blocks if b.startswith("working tree: WAKE of a parked model"))
    idle = next(b for b in blocks if b.startswith("working tree: IDLE PARK by a reconcile pass"))
    for text in (wake, idle):
        counts = re.search(r"steps: (\d+) +distinct modules: (\d+) +scheduler<->ledger "
                           r"hand-offs: (\d+)", text)  # fmt: skip
        assert counts, text
        steps, distinct, _ = map(int, counts.groups())
        assert steps >= distinct > 1
        assert "entered (times):" in text
    walk = re.findall(r"\d+\. (\S+)", wake.split("  walk:\n")[1].split("  entered")[0])
    assert walk[0] == "capyctl.scheduler.gateway_api", walk[:3]
    assert "capyctl.scheduler.drivers" in walk, walk
    assert any(m.startswith("capyctl.scheduler.transitions") for m in walk), walk
    assert any(m.startswith("capyctl.ledger.") for m in walk), walk
    assert all(m.startswith(("capyctl.", "hostagent.")) for m in walk), walk
    entered = {
        m: int(n) for n, m in re.findall(r"^ +(\d+)  (\S+)$", wake.split("entered")[1], re.M)
    }
    assert sum(entered.values()) == len(walk)
