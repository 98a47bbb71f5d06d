"""bench/adapters.py runs, briefly: six fine-tunes as adapters of one base and as whole
models, the same short trace through each, its figures side by side."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_adapters_bench_serves_the_trace_both_ways_and_switches_no_model_for_adapters(
    tmp_path,
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    done = subprocess.run(
        [sys.executable, "bench/adapters.py", "--count", "6", "--requests", "24"],
        capture_output=True, text=True, timeout=240, check=False, cwd=ROOT,
        env={**env, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("6 fine-tunes, 24 requests from 8 clients"), lines[0]
    header = next(line for line in lines if "adapters (one base)" in line)
    assert "whole models" in header
    rows = {
        line[:36].strip(): re.split(r"\s{2,}", line[36:].strip())
        for line in lines[lines.index(header) + 1 :]
        if line.startswith("  ") and line[36:].strip()
    }
    requests = rows["requests, served"]
    assert [r.split(",")[0] for r in requests] == ["24", "24"], requests
    # The trace asks for a fifth fine-tune while four are resident: a load, and a wake.
    adapter_loads, model_loads = rows["adapter loads /100 requests"]
    assert not adapter_loads.startswith("0.0"), adapter_loads
    assert model_loads.startswith("0.0 (0 loaded"), model_loads
    adapter_switches, model_switches = rows["model switches /100 requests"]
    assert adapter_switches.startswith("0.0 (0 parked, 0 stopped)"), adapter_switches
    assert not model_switches.startswith("0.0"), model_switches
    assert rows["wakes, starts"][0] == "0, 0"
    assert any(line.startswith("model switches with adapters: 0 (none") for line in lines)
    assert (
        sum(line.startswith("wall p") and "whole models / adapters" in line for line in lines) == 2
    )
    assert not list(tmp_path.glob("capyctl-bench-adapters-*")), "its servers' folders remain"
