"""One process of the multi-process stress (``tests/test_stress_processes.py``).

Run as ``python -m tests.stress_worker ROLE ...`` with a capyctl environment (data dir,
database, Redis in server mode); what it saw goes to stdout as one JSON object at the end.

- ``work SEED WORKER STEPS NAME...``: a seeded random schedule of starts, wakes, parks and
  stops, called the way a Celery worker or a ``capyctl`` command calls the scheduler.
- ``reconcile HOST STOPFILE``: reconcile passes over the host named ``HOST`` until
  ``STOPFILE`` exists.
- ``watch HOST SIMDIR STOPFILE``: looks under the host lock until ``STOPFILE`` exists, and
  once more after: no pool's entries past its capacity, and the ledger never counting less
  on a GPU than the simulated device (the agent's files in ``SIMDIR``) shows there.
- ``serve SEED STOPFILE NAME...`` (server mode): requests in flight, counted as the gateway
  counts them: one on each ready model at a time, held 0.5 to 2 s, and across a Redis
  outage until Redis has answered again for 3 s. One whose model begins to drain is held
  3 s more (a long answer), and ``draining`` beside ``STOPFILE`` says so: the test's Redis
  outage then begins while that drain polls the counts. A model parked while one of them
  is counted is a defect (a park drains first).

Each process has its own per-model locks, turn waits and database connection, so only what
is shared across processes (the host lock, the conditional updates, the ledger) keeps them
apart: the thing under test.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

TICK_SECONDS = 0.5


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "capyctl.settings")
    import django

    django.setup()


def step(rng: random.Random, ids: list[int], timeout: float) -> str:
    """One random operation, as a person or a request asks for it; its name, or the
    scheduler's refusal (``SchedulerError``) raised."""
    from capyctl.scheduler import actions

    target = rng.choice(ids)
    action = rng.choice(["ready", "ready", "ready", "park", "stop", "start"])
    if action == "ready":
        actions.ensure_ready(target, timeout=timeout)
    elif action == "park":
        actions.park(target, rng.choice(["ram", "deep", None]))
    elif action == "stop":
        actions.stop(target)
    else:
        actions.start(target)
    return action


def work(seed: int, worker: int, steps: int, names: list[str]) -> dict[str, object]:
    from capyctl.deployments.models import Deployment
    from capyctl.scheduler.errors import SchedulerError

    ids = [Deployment.objects.get(name=name).pk for name in names]
    rng = random.Random(seed * 100 + worker)  # noqa: S311 - a seeded, repeatable schedule
    codes: Counter[str] = Counter()
    done: Counter[str] = Counter()
    errors: list[str] = []
    for _ in range(steps):
        # Steps begin together in every process, on the same tick of the shared clock, so
        # the admissions and state changes they make race each other.
        time.sleep(TICK_SECONDS - time.time() % TICK_SECONDS)
        try:
            done[step(rng, ids, timeout=30)] += 1
        except SchedulerError as exc:
            codes[exc.code] += 1
        except Exception as exc:  # anything else is a defect
            errors.append(f"worker {worker}: {type(exc).__name__}: {exc}")
            errors.append(traceback.format_exc(limit=6))
    return {"codes": dict(codes), "done": dict(done), "errors": errors}


def reconciling(host: int, stopfile: Path) -> dict[str, object]:
    from capyctl.scheduler.reconcile import reconcile

    passes = 0
    errors: list[str] = []
    while not stopfile.exists():
        try:
            reconcile(host)
            passes += 1
        except Exception as exc:  # a pass must never fail
            errors.append(f"reconcile: {type(exc).__name__}: {exc}")
        time.sleep(0.3)
    return {"passes": passes, "errors": errors}


def look(host: int, simdir: Path) -> list[str]:
    from capyctl.ledger.models import LedgerEntry
    from capyctl.ledger.services import host_lock, overcommitted
    from hostagent.simgpu import read_allocations

    found = []
    with host_lock(host) as locked:
        for usage in overcommitted(locked):
            found.append(f"{usage.pool}: {usage.used_bytes} > {usage.capacity_bytes}")
        on_device: Counter[int] = Counter()
        for allocation in read_allocations(simdir):
            on_device.update(allocation.gpu)
        for index, used in sorted(on_device.items()):
            pool = f"gpu{index}"
            counted = sum(
                LedgerEntry.objects.filter(host=locked, pool=pool).values_list("bytes", flat=True)
            )
            if counted < used:
                found.append(f"{pool}: counted {counted} < on the device {used}")
    return found


def watching(host: int, simdir: Path, stopfile: Path) -> dict[str, object]:
    found: list[str] = []
    looks = 0
    while True:
        last = stopfile.exists()
        found.extend(look(host, simdir))
        looks += 1
        if last:
            break
        # On SQLite the host lock is the database's write lock: looks back to back would
        # starve the writers they watch.
        time.sleep(0.05)
    return {"looks": looks, "found": found}


HELD_AFTER_OUTAGE_SECONDS = 3.0
DRAINED_HOLD_SECONDS = 3.0


def serving(seed: int, stopfile: Path, names: list[str]) -> dict[str, object]:
    from capyctl.deployments.models import Deployment
    from capyctl.scheduler import requests_in_progress

    ids = {Deployment.objects.get(name=name).pk: name for name in names}
    rng = random.Random(seed)  # noqa: S311 - a seeded, repeatable schedule
    held: dict[int, float] = {}  # deployment -> when its request ends (monotonic)
    drained: set[int] = set()  # held ones a drain waited for
    errors: list[str] = []
    served = outages = waited = 0
    back_since: float | None = time.monotonic()  # Redis has answered since
    while not stopfile.exists():
        now = time.monotonic()
        if requests_in_progress.down_since() is not None:
            back_since = None
        elif back_since is None:
            back_since, outages = now, outages + 1
        states = dict(Deployment.objects.filter(pk__in=ids).values_list("pk", "observed_state"))
        settled = back_since is not None and now - back_since >= HELD_AFTER_OUTAGE_SECONDS
        for deployment_id, ends in list(held.items()):
            observed = states.get(deployment_id)
            until = ends
            if observed in ("parking", "parked"):
                errors.append(f"{ids[deployment_id]} was {observed} with a request in flight")
            if observed == "draining" and deployment_id not in drained:
                drained.add(deployment_id)
                waited += 1
                held[deployment_id] = until = max(until, now + DRAINED_HOLD_SECONDS)
                stopfile.with_name("draining").touch()
            if observed not in ("ready", "draining") or (now >= until and settled):
                requests_in_progress.end(deployment_id)  # served, or cut (a person's stop)
                del held[deployment_id]
                drained.discard(deployment_id)
                served += 1
        for deployment_id, observed in states.items():
            if (
                observed == "ready"
                and deployment_id not in held
                and requests_in_progress.begin(deployment_id)
            ):
                held[deployment_id] = now + rng.uniform(0.5, 2)
        time.sleep(0.05)
    for deployment_id in held:
        requests_in_progress.end(deployment_id)
    return {"served": served, "outages": outages, "drains_waited": waited, "errors": errors}


def main(argv: list[str]) -> int:
    role, *rest = argv
    _setup()
    from capyctl.hosts.models import Host

    if role == "work":
        seed, worker, steps, *names = rest
        report = work(int(seed), int(worker), int(steps), names)
    elif role == "reconcile":
        report = reconciling(Host.objects.get(name=rest[0]).pk, Path(rest[1]))
    elif role == "watch":
        report = watching(Host.objects.get(name=rest[0]).pk, Path(rest[1]), Path(rest[2]))
    elif role == "serve":
        seed, stopfile, *names = rest
        report = serving(int(seed), Path(stopfile), names)
    else:
        sys.stderr.write(f"unknown role {role!r}\n")
        return 2
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
