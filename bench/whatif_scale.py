"""The simulator at the size of a large installation: a synthetic day.

100,000 requests over 24 hours (a daily swell, busiest at midday) for 1,000 deployments
(popularity by Zipf's law: a few models take most requests) on 100 hosts of 8 GPUs of
80 GiB; each model takes 1, 2 or 4 GPUs (about 2 on average: some 20 GPUs of models for
each host's 8) with claims of 20 to 70 GiB a GPU, so the busy hosts switch all day. Engine timings are
vLLM's defaults (docs/what-if.md). Printed: the replay's wall time and events per second,
the policy's calls and their time (what a request that needs a switch waits on), and the
time of one placement decision across all 100 hosts (a deployment not yet placed: every
host's snapshot planned at once) against the 10 ms target.

Run: .venv/bin/python bench/whatif_scale.py [--requests 100000] [--models 1000] [--hosts 100]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")
# Django needs a data dir; the replay writes nothing there.
os.environ.setdefault("CAPYCTL_DATA_DIR", tempfile.mkdtemp(prefix="capyctl-bench-"))

GIB = 1024**3


def day(args: argparse.Namespace) -> tuple[object, list[object]]:
    from capyctl.whatif.model import Request, Scenario, SimHost, SimModel, Timings

    rng = random.Random(args.seed)
    hosts = [SimHost(f"h{i + 1}", [80 * GIB] * args.gpus, 1024 * GIB) for i in range(args.hosts)]
    models = []
    for i in range(args.models):
        models.append(
            SimModel(
                f"m{i + 1}",
                host=hosts[i % len(hosts)].name,
                gpus=rng.choice([1, 1, 2, 4]),  # some tensor-parallel: ~2 GPUs a model
                claim_bytes=rng.choice([20, 40, 70]) * GIB,
                weights_bytes=rng.choice([8, 16, 32]) * GIB,
                timings=Timings.for_kind("vllm"),
            )
        )
    ranks = range(args.models)
    cumulative = list(itertools.accumulate(1 / (rank + 1) for rank in ranks))
    order = list(range(args.models))
    rng.shuffle(order)
    requests = []
    for _ in range(args.requests):
        # a daily swell: arrivals thicker around midday
        at = (rng.betavariate(2.2, 2.2)) * 86400
        index = order[rng.choices(ranks, cum_weights=cumulative)[0]]
        service = min(rng.lognormvariate(math.log(1.5), 0.6), 60.0)
        requests.append(Request(at, models[index].name, service))
    requests.sort(key=lambda r: r.at)
    return Scenario(hosts, models, "synthetic day"), requests


def placement_ms(scenario: object, repeats: int) -> list[float]:
    """One decision for a deployment with no host yet: plan() over every host at once,
    each with its residents as the day left them."""
    from capyctl.scheduler.policy import Need, plan
    from capyctl.whatif.engine import Replay

    replay = Replay(scenario, [])  # type: ignore[arg-type]
    rng = random.Random(1)
    for host in replay.hosts:  # each host as busy as the day makes it: GPUs nearly full
        for model in list(replay.models)[host.id - 1 :: len(replay.hosts)][:6]:
            pools = tuple(f"gpu{rng.randrange(len(host.spec.gpus))}" for _ in range(1))
            model.host, model.pools, model.state = host, pools, "ready"
            model.entries = {pools[0]: model.spec.claim_bytes, "ram": 512 * 1024**2}
            host.models[model.id] = model
    snapshots = [replay._snapshot(h) for h in replay.hosts]
    times = []
    for i in range(repeats):
        need = Need(10**6 + i, "new", 1, 60 * GIB, 512 * 1024**2)
        began = time.perf_counter()
        plan(snapshots, need)
        times.append((time.perf_counter() - began) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    import django

    django.setup()
    from capyctl.whatif import report
    from capyctl.whatif.engine import replay

    began = time.perf_counter()
    scenario, requests = day(args)
    made = time.perf_counter() - began
    outcome = replay(scenario, requests)  # type: ignore[arg-type]
    result = report.summary(outcome)
    overall, sim = result["overall"], result["simulator"]
    switches = sum(overall["switches"].values())
    print(f"{args.requests} requests, {args.models} deployments, {args.hosts} hosts x "
          f"{args.gpus} GPUs of 80 GiB (trace made in {made:.1f} s)")  # fmt: skip
    print(f"replayed {overall['replayed_seconds'] / 3600:.1f} h in {outcome.wall_seconds:.1f} s: "
          f"{sim['events']} events, {sim['events_per_second']} events/s")  # fmt: skip
    print(f"served {overall['served']}, refused {overall['refused']}, switches {switches} "
          f"({overall['switches']}), wait p50 {overall['wait_p50_seconds']} s "
          f"p99 {overall['wait_p99_seconds']} s")  # fmt: skip
    print(f"policy: {sim['plans']} calls, {sim['plan_ms_mean']:.3f} ms each "
          f"({1000 * outcome.plan_seconds / len(requests):.3f} ms per request)")  # fmt: skip
    times = placement_ms(scenario, 50)
    p99 = sorted(times)[int(len(times) * 0.99) - 1]
    verdict = "within" if statistics.median(times) <= 10 else "PAST"
    print(f"placement decision across all {args.hosts} hosts ({args.hosts * args.gpus} GPUs): "
          f"median {statistics.median(times):.2f} ms, p99 {p99:.2f} ms: {verdict} the 10 ms "
          "target")  # fmt: skip
    total = time.perf_counter() - began
    print(f"all in {total:.1f} s: {'within' if total < 60 else 'PAST'} the minute")


if __name__ == "__main__":
    main()
