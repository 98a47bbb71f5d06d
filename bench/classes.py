"""Priority classes: an interactive key's waits with a batch key on the same GPU.

Two simulated vLLM models of 16 GiB share a simulated 24 GiB GPU, so only one holds it at
a time (a park 0.1 s, a wake 0.2 s; turns of ``--turn`` seconds). Key 1 asks ``a`` in
pairs every 2 s (a person at a chat app); key 2 asks ``b`` four times a second (a batch
job), for ``--seconds``. The same trace runs twice through ``/v1`` of a real standalone
CapyCTL, a fresh server each time: key 2 interactive, then key 2 batch. Printed per run:
the interactive key's p50 and p99 wait (``x-capyctl-queued-ms``), the batch key's p99
and its answers, the switches; then the ratio of the interactive p99s (batch / both
interactive: the target is at most 0.5) and the same two runs in the what-if simulator.

Run: .venv/bin/python bench/classes.py [--seconds 30] [--turn 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness is the tests' own: tests/live_replay.py
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")

import django  # noqa: E402

django.setup()

from capyctl.whatif.engine import replay as simulate  # noqa: E402
from capyctl.whatif.model import GIB, Request, Scenario, SimHost, SimModel, Timings  # noqa: E402
from tests.live_replay import LiveModel, LiveTimings, replay  # noqa: E402
from tests.test_priority_classes import contended_trace, p99  # noqa: E402

PARK, WAKE, SERVICE = 0.1, 0.2, 0.16


def live(trace: list[dict[str, object]], turn: int, classes: bool) -> dict[str, float]:
    timings = LiveTimings(park_ram=PARK, wake_ram=WAKE, tokens_per_second=100)
    models = [LiveModel(name, weights="2GiB", max_turn_seconds=turn) for name in "ab"]
    result = replay(trace, models, timings=timings, classes=classes)
    mine = [r["queued_ms"] / 1000 for r in result.requests if r["class"] == "interactive"]
    theirs = [r for r in result.requests if r["class"] == "batch"]
    return {
        "p50": statistics.median(mine),
        "p99": p99(mine),
        "batch_p99": p99([r["queued_ms"] / 1000 for r in theirs if r["status"] == 200] or [0]),
        "batch_ok": sum(r["status"] == 200 for r in theirs),
        "batch_all": len(theirs),
        "parks": sum(v for k, v in result.switches.items() if k.startswith("park")),
    }


def simulated(trace: list[dict[str, object]], turn: int, classes: bool) -> float:
    timings = Timings(start=0.5, park_ram=PARK, park_deep=PARK, wake_ram=WAKE,
                      wake_deep=WAKE, stop=0.1, service=SERVICE)  # fmt: skip
    models = [SimModel(name, min_ready_seconds=0, max_turn_seconds=turn, timings=timings)
              for name in "ab"]  # fmt: skip
    scenario = Scenario([SimHost("h1", [24 * GIB], 64 * GIB)], models,
                        batch_keys=frozenset({2} if classes else ()))  # fmt: skip
    requests = [Request(float(str(r["at"])), str(r["model"]), SERVICE,
                        2 if r.get("class") == "batch" else 1) for r in trace]  # fmt: skip
    outcome = simulate(scenario, requests)
    return p99([r.waited for r in outcome.requests if r.model == "a"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--turn", type=int, default=4)
    args = parser.parse_args()
    trace = contended_trace(args.seconds)
    runs = {}
    for classes in (False, True):
        name = "key 2 batch" if classes else "both interactive"
        runs[classes] = figures = live(trace, args.turn, classes)
        print(f"{name:<17} interactive wait p50 {figures['p50']:.2f} s, p99 "
              f"{figures['p99']:.2f} s; batch p99 {figures['batch_p99']:.2f} s, answered "
              f"{figures['batch_ok']:.0f}/{figures['batch_all']:.0f}; parks "
              f"{figures['parks']:.0f}")  # fmt: skip
    ratio = runs[True]["p99"] / runs[False]["p99"]
    sims = {classes: simulated(trace, args.turn, classes) for classes in (False, True)}
    print(f"interactive p99, batch / both interactive: {ratio:.2f} (target <= 0.50)")
    print(f"the what-if simulator: {sims[False]:.2f} s -> {sims[True]:.2f} s "
          f"({sims[True] / sims[False]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
