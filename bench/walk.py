"""Which CapyCTL modules a scheduler operation passes through, in order.

A developer's tool, and figures for notes on the scheduler's layout. The set-up is
bench/switch.py's standalone side (CapyCTL in this process with SQLite, a simulated 24 GiB
GPU, two simulated vLLM models of 16 GiB whose engines park and wake in 0 s). Every
function call made meanwhile in a module named ``capyctl.*`` or ``hostagent.*`` is noted
(``sys.setprofile``, and ``threading.setprofile`` for the threads the scheduler runs the
work on); calls into Django and other libraries are not, though what they call back in
CapyCTL is. Two operations are walked:

wake       the parked model woken while there is room for it (the other model was parked
           first, unrecorded): from the gateway's call into the scheduler
           (``await gateway_api.ready(pk, timeout)``, as ``/v1`` does; a tree without
           ``gateway_api``: ``operations.ensure_ready(pk)``) until it returns.
idle park  one reconcile pass (``reconcile.reconcile(host_id)``) over the host whose ready
           model has been idle past its ``idle_park_seconds`` (its last request and its
           last change of state set an hour back), so that the pass parks it.

For each: the walk (the module of each call, in the order the calls were made, a run of
calls in one module counted as one step), the number of steps and of distinct modules,
how many times each module is entered (the steps it has), and the hand-offs between the
scheduler (``capyctl.scheduler.*``) and the ledger (``capyctl.ledger.*``): how many times
the walk, read for its steps in those two only, goes from one to the other. Only calls are
noted: a return to the caller is not a step, so "A calls B, B returns, A calls C" reads
"A, B, C". The calls counted are those on the calling thread and on the threads it hands
the work to (a thread whose first call is in the scheduler: the wake's pool); calls on
other threads meanwhile (an engine's log reader) are left out, and their number said.

``--rev REV`` (repeatable): walk REV's code instead of the working tree's (a ``git
worktree`` in a temporary folder, removed after, run with this venv through
``PYTHONPATH``, as bench/switch.py does). ``--calls``: under each walk, the functions each
step called first (module.function).

Run: .venv/bin/python bench/walk.py [--rev REV ...] [--calls]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from switch import ROOT, InProcess, worktree

PREFIXES = ("capyctl.", "hostagent.")
SCHEDULER, LEDGER = "capyctl.scheduler", "capyctl.ledger"
WIDTH = 100
Call = tuple[str, str, str]  # the thread's name, the module, the function


class Recorder:
    """The CapyCTL calls made while ``on``, in every thread it is set in: (thread, module,
    function)."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[Call] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith(PREFIXES):
            thread = threading.current_thread().name
            self.calls.append((thread, module, frame.f_code.co_name))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Call]]:
        self.calls = []
        sys.setprofile(self)
        self.on = True
        try:
            yield self.calls
        finally:
            self.on = False
            sys.setprofile(None)


def steps(calls: list[Call]) -> list[tuple[str, str]]:
    """Consecutive calls in one module as one step: (module, the step's first function)."""
    walk: list[tuple[str, str]] = []
    for _, module, function in calls:
        if not walk or walk[-1][0] != module:
            walk.append((module, function))
    return walk


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def hand_offs(modules: list[str]) -> int:
    """How many times the walk, read for its scheduler and ledger steps only, goes from
    one to the other (the steps in other modules between them are passed over)."""
    sides = [side for m in modules for side in (SCHEDULER, LEDGER) if _in(m, side)]
    return sum(a != b for a, b in itertools.pairwise(sides))


def own_threads(calls: list[Call], caller: str) -> tuple[list[Call], Counter[str]]:
    """The calls of the operation: on the calling thread, and on threads whose first call
    while recording was in the scheduler (those it handed the work to: the wake's pool).
    The others (an engine's log reader) are left out; their calls are counted by thread."""
    first: dict[str, str] = {}
    for thread, module, _ in calls:
        first.setdefault(thread, module)
    kept = {t for t, module in first.items() if t == caller or _in(module, SCHEDULER)}
    left_out = Counter(thread for thread, _, _ in calls if thread not in kept)
    return [call for call in calls if call[0] in kept], left_out


def block(title: str, recorded: list[Call], *, show_calls: bool) -> str:
    """One operation's walk and its counts, as text."""
    calls, left_out = own_threads(recorded, threading.current_thread().name)
    walk = steps(calls)
    modules = [module for module, _ in walk]
    threads = list(dict.fromkeys(thread for thread, _, _ in calls))
    lines = [title]
    lines.append(
        f"  steps: {len(walk)}   distinct modules: {len(set(modules))}   "
        f"scheduler<->ledger hand-offs: {hand_offs(modules)}"
    )
    lines.append(f"  calls: {len(calls)}, on {', '.join(threads)}")
    if left_out:
        others = ", ".join(f"{count} on {thread}" for thread, count in left_out.items())
        lines.append(f"  left out: calls on other threads ({others})")
    lines.append("  walk:")
    cells = [
        f"{n}. {module}" + (f" ({function})" if show_calls else "")
        for n, (module, function) in enumerate(walk, 1)
    ]
    line = "   "
    for cell in cells:
        if len(line) + 2 + len(cell) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = "   "
        line += " " + cell + " "
    if line.strip():
        lines.append(line.rstrip())
    lines.append("  entered (times):")
    for module, times in sorted(Counter(modules).items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"    {times:>4}  {module}")
    return "\n".join(lines)


# --- one tree's walks, in this process (run as a child, one per tree) ------------------


def _verbs() -> Any:
    """The module of the verbs: ``operations`` in older trees, ``actions`` since."""
    try:
        from capyctl.scheduler import operations  # type: ignore[attr-defined]
    except ImportError:
        from capyctl.scheduler import actions

        return actions
    return operations


def _has(module: str) -> bool:
    return importlib.util.find_spec(f"capyctl.scheduler.{module}") is not None


def _state(pk: int) -> str:
    from capyctl.deployments.models import Deployment

    return str(Deployment.objects.get(pk=pk).observed_state)


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise RuntimeError(what)


def walk_side(label: str, expected: str, *, show_calls: bool) -> None:
    """Set up, walk a wake and an idle park, print both blocks."""
    recorder = Recorder()
    threading.setprofile(recorder)  # the threads the scheduler starts (its wake pool)
    side = InProcess()
    import capyctl

    where = Path(capyctl.__file__).parent
    if expected and where != Path(expected):
        raise RuntimeError(f"the walk of {expected} runs the capyctl of {where}")
    from django.utils import timezone

    from capyctl.deployments.models import Deployment
    from capyctl.hosts.models import Host
    from capyctl.scheduler import reconcile

    try:
        parked, other = side.models  # the set-up woke a, then b: a is parked
        verbs = _verbs()
        verbs.park(other.pk)  # room for the wake: nothing to evict
        states = dict(Deployment.objects.values_list("name", "observed_state"))
        _expect(states == {"a": "parked", "b": "parked"}, f"before the wake: {states}")
        with recorder.recording() as calls:
            side.wake(parked.pk)
        _expect(_state(parked.pk) == "ready", "the wake did not make the model ready")
        entry = "gateway_api.ready" if _has("gateway_api") else "operations.ensure_ready"
        title = f"{label}: WAKE of a parked model ({entry}, room on the GPU)"
        print(block(title, calls, show_calls=show_calls), end="\n\n", flush=True)

        an_hour_ago = timezone.now() - timedelta(hours=1)
        Deployment.objects.filter(pk=parked.pk).update(
            idle_park_seconds=60, last_request_at=an_hour_ago, state_changed_at=an_hour_ago
        )
        host_id = Host.objects.get().pk
        with recorder.recording() as calls:
            reconcile.reconcile(host_id)
        _expect(_state(parked.pk) == "parked", "the reconcile pass did not park the model")
        title = f"{label}: IDLE PARK by a reconcile pass (reconcile.reconcile, 60 s idle)"
        print(block(title, calls, show_calls=show_calls), end="\n\n", flush=True)
    finally:
        threading.setprofile(None)
        side.close()


# --- the parent: one child per tree ------------------------------------------------------


def run_tree(tree: Path, label: str, *, show_calls: bool) -> None:
    """Walk ``tree``'s code in a process of its own, its output printed here."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--side", label,
               "--expect", str(tree / "capyctl")] + (["--calls"] if show_calls else [])  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tree, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the walk of {label} failed (exit {done.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", metavar="REV", action="append",
                        help="walk REV's code instead of the working tree's (repeatable)")  # fmt: skip
    parser.add_argument("--calls", action="store_true",
                        help="name each step's first function too")  # fmt: skip
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--expect", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        walk_side(args.side, args.expect, show_calls=args.calls)
        return
    print("the CapyCTL modules (capyctl.*, hostagent.*) a scheduler operation calls, in order; "
          "consecutive calls in one module are one step\n", flush=True)  # fmt: skip
    if not args.rev:
        run_tree(ROOT, "working tree", show_calls=args.calls)
    for rev in args.rev or []:
        with worktree(rev) as (tree, commit):
            run_tree(tree, f"{rev} ({commit})" if rev != commit else commit,
                     show_calls=args.calls)  # fmt: skip


if __name__ == "__main__":
    main()
