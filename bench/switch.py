"""How long a switch takes, and how much of it is CapyCTL's own time.

Two simulated vLLM models of 16 GiB share a simulated 24 GiB GPU; the engine parks and
wakes in 0 s. Each round asks for the parked one while the other holds the GPU.

Standalone (the default): CapyCTL in one process with SQLite. A round awaits the
gateway's wake call (``gateway_api.ready``, as ``/v1`` does for a model that is not
ready), then sends the request straight to the engine, and times it to the first byte of
the answer. The engine's own time, its answers to the park and wake calls (``/sleep``,
``/wake_up``), to the calls that check its state after them (``/is_sleeping``,
``/health``) and to the request, is timed apart; the rest is CapyCTL's own share. Printed
too: the share with the state checks counted as CapyCTL's (how this benchmark measured it
until they were timed apart), and with the host driver's whole park and wake calls
counted as the engine's.

``--server``: server mode as a user runs it: PostgreSQL (a database of the benchmark's
own, dropped after), Redis (an empty database index, claimed), ``capyctl start server``
with one Celery worker, and a host agent (``capyctl start host``) joined over mutual TLS.
A round sends the request to ``/v1`` from outside and times it to the first byte of the
answer; the park's and the wake's events say when each ended and how long it took, which
splits the rest into before the park and after the wake (bench/switch_server.py).

``--rev REV``: measure REV's code instead of the working tree's. ``--against REV``: the
same rounds on REV's code (old) and on the working tree's or ``--rev``'s (new),
alternating round by round, so that a busy moment of a shared machine falls on both;
printed: both medians and their ratio. Each tree other than the working tree is a ``git
worktree`` in a temporary folder (removed after), run with this venv through
``PYTHONPATH``.

Run: .venv/bin/python bench/switch.py [--rounds 30] [--server] [--rev REV] [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GIT = shutil.which("git") or "git"
PARK_PATHS = {"/sleep", "/release_memory_occupation"}
WAKE_PATHS = {"/wake_up", "/resume_memory_occupation", "/collective_rpc", "/reset_prefix_cache"}


# --- one side: CapyCTL standalone in this process (run as a child, one per tree) -------


def _standalone_env() -> str:
    data = tempfile.mkdtemp(prefix="capyctl-bench-switch-")
    for name in [k for k in os.environ if k.startswith("CAPYCTL_")]:
        del os.environ[name]
    os.environ.update(
        {
            "CAPYCTL_DATA_DIR": data,
            "CAPYCTL_SIM_GPUS": "24GiB",
            "CAPYCTL_MIN_READY_SECONDS": "0",
            "CAPYCTL_GPU_RESERVE": "0",
            "CAPYCTL_LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "capyctl.settings",
        }
    )
    return data


class InProcess:
    """Two models on CapyCTL standalone in this process; the engine's time counted apart:
    its answers to the park and wake calls (``engine_ms``, timed at httpx's ``send``), and
    the host driver's whole park and wake calls (``driver``)."""

    def __init__(self) -> None:
        self.data = _standalone_env()
        import django
        import httpx

        django.setup()
        from capyctl.bootstrap import prepare_standalone

        prepare_standalone()
        from capyctl.deployments.models import Instance
        from capyctl.deployments.services import DeploymentSpec, add_deployment
        from capyctl.engines.services import add_engine
        from capyctl.scheduler import drivers

        self.engine_ms = {"park": 0.0, "wake": 0.0, "checks": 0.0, "driver": 0.0}
        self._time_engine_calls(httpx.Client)
        add_engine(
            "sim",
            kind="vllm",
            command=f"{sys.executable} -m hostagent.sim vllm",
            env={"CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB", "CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB",
                 "CAPYCTL_SIM_SLEEP_SECONDS": "0", "CAPYCTL_SIM_WAKE_SECONDS": "0"},
        )  # fmt: skip
        spec = {"engine": "sim", "gpu_memory_bytes": 16 * 1024**3}
        self.models = [
            add_deployment(DeploymentSpec(name=n, source=f"m-{n}", **spec)) for n in ("a", "b")
        ]
        self.driver = drivers.local_driver()
        for name in ("park", "wake"):
            setattr(self.driver, name, self._timed(getattr(self.driver, name)))
        self.loop = asyncio.new_event_loop()
        self.engines: dict[int, tuple[httpx.Client, str, str]] = {}
        for model in self.models:
            self.wake(model.pk)
            row = Instance.objects.exclude(state="exited").get(deployment=model)
            socket = getattr(row, "socket_path", None)  # None in trees from before sockets
            transport = httpx.HTTPTransport(uds=socket) if socket else None
            base = "http://localhost" if socket else f"http://127.0.0.1:{row.port}"
            self.engines[model.pk] = (httpx.Client(transport=transport), base, row.launch_key)
        self.turn = 0

    def _time_engine_calls(self, client_class: Any) -> None:
        send = client_class.send
        engine_ms = self.engine_ms

        def timed_send(client: Any, request: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return send(client, request, **kw)
            finally:
                path = request.url.path
                which = "park" if path in PARK_PATHS else "wake" if path in WAKE_PATHS else None
                if which and request.method == "POST":
                    engine_ms[which] += (time.perf_counter() - started) * 1000
                elif not path.startswith("/v1/"):  # its state asked: asleep? healthy?
                    engine_ms["checks"] += (time.perf_counter() - started) * 1000

        client_class.send = timed_send

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                self.engine_ms["driver"] += (time.perf_counter() - started) * 1000

        return wrapper

    def wake(self, pk: int) -> str:
        """What ``/v1`` awaits for a model that is not ready: the gateway's wake call."""
        try:
            from capyctl.scheduler import gateway_api
        except ImportError:  # a tree from before the gateway's one scheduler module
            from capyctl.scheduler import operations

            operations.ensure_ready(pk)
            return ""
        return str(self.loop.run_until_complete(gateway_api.ready(pk, 60.0)))

    def round(self) -> dict[str, Any]:
        target = self.models[self.turn % 2]  # the parked one
        self.turn += 1
        client, base, key = self.engines[target.pk]
        for name in self.engine_ms:
            self.engine_ms[name] = 0.0
        body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}],
                "stream": True}  # fmt: skip
        started = time.perf_counter()
        header = self.wake(target.pk)
        request_started = time.perf_counter()
        with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
            chunks = response.iter_raw()
            next(chunks)
            first_byte = time.perf_counter()
            for _ in chunks:  # the rest of the answer: the request ends before the next
                pass
        total = (first_byte - started) * 1000
        request = (first_byte - request_started) * 1000
        calls = self.engine_ms["park"] + self.engine_ms["wake"] + request
        return {
            "total": total,
            "own": total - calls - self.engine_ms["checks"],
            "own_posts": total - calls,
            "own_driver": total - self.engine_ms["driver"] - request,
            "engine_park": self.engine_ms["park"],
            "engine_wake": self.engine_ms["wake"],
            "engine_checks": self.engine_ms["checks"],
            "request": request,
            "switch": header,
        }

    def close(self) -> None:
        self.loop.close()
        self.driver.stop_all(grace_seconds=2)
        shutil.rmtree(self.data, ignore_errors=True)


def standalone_side() -> None:
    """Set up, then answer each ``round`` line on stdin with one JSON line."""
    side = InProcess()
    import capyctl

    print(json.dumps({"capyctl": str(Path(capyctl.__file__).parent)}), flush=True)
    try:
        for line in sys.stdin:
            if line.strip() != "round":
                break
            print(json.dumps(side.round()), flush=True)
    finally:
        side.close()


# --- the parent: sides, rounds, figures ------------------------------------------------


class ChildSide:
    """A standalone side in a process of its own, on one tree's code."""

    def __init__(self, tree: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--side", "standalone"],
            env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        hello = self._read()
        if Path(hello["capyctl"]) != tree / "capyctl":
            raise RuntimeError(f"the side for {tree} runs the capyctl of {hello['capyctl']}")

    def _read(self) -> dict[str, Any]:
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line:
            raise RuntimeError(f"the side ended (exit {self.process.wait()})")
        return dict(json.loads(line))

    def round(self) -> dict[str, Any]:
        if self.process.stdin:
            self.process.stdin.write("round\n")
            self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, AttributeError):
            self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[tuple[Path, str]]:
    """REV's tree in a temporary folder, and its short commit id."""
    commit = subprocess.run([GIT, "rev-parse", "--short", f"{rev}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="capyctl-switch-old-")) / "tree"
    subprocess.run([GIT, "worktree", "add", "--detach", "--quiet", str(folder), commit],
                   cwd=ROOT, check=True)  # fmt: skip
    try:
        yield folder, commit
    finally:
        subprocess.run([GIT, "worktree", "remove", "--force", str(folder)], cwd=ROOT,
                       check=False)  # fmt: skip
        shutil.rmtree(folder.parent, ignore_errors=True)


def spread(values: list[float]) -> str:
    """Median, with the 10th to 90th percentile."""
    if len(values) < 2:
        return f"{values[0]:.1f} ms"
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return f"{statistics.median(values):.1f} ms ({deciles[0]:.1f}-{deciles[-1]:.1f})"


def run_rounds(sides: dict[str, Any], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` rounds on each side; with two, they alternate, each going first in turn."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    names = list(sides)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            results[name].append(sides[name].round())
    return results


# What each figure is called, by mode: the key in a round's result, the label.
FIGURES = {
    "standalone": [
        ("total", "request -> first byte"),
        ("own", "CapyCTL's own share"),
        ("own_posts", "  with the engine's state checks"),
        ("own_driver", "  outside the driver's park/wake"),
        ("engine_park", "engine: park call"),
        ("engine_wake", "engine: wake call"),
        ("engine_checks", "engine: its state checks"),
        ("request", "engine: the request"),
    ],
    "server": [
        ("total", "request -> first byte"),
        ("park", "park (its event)"),
        ("wake", "wake (its event, after the park)"),
        ("rest", "the rest"),
        ("before", "  request -> the park begins"),
        ("after", "  the wake ends -> first byte"),
        ("ready", "request to the ready model"),
        ("told_park", "x-capyctl-switch: parked"),
        ("told_wake", "x-capyctl-switch: woke"),
    ],
}
TARGETS = {"standalone": ("own", 10.0), "server": ("total", 150.0)}


def report(mode: str, results: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> None:
    names = list(results)
    column = max(len(label) for _, label in FIGURES[mode])
    if len(names) == 1:
        values = results[names[0]]
        for key, label in FIGURES[mode]:
            figures = [r[key] for r in values]
            share = ""
            if key == "own":
                share = f", {statistics.median(figures) / statistics.median(r['total'] for r in values):.0%} of the switch"
            print(f"  {label:<{column}}  median {spread(figures)}{share}")
    else:
        print(f"  {'':<{column}}  " + "   ".join(f"{labels[n]:<24}" for n in names) + "  new/old")
        for key, label in FIGURES[mode]:
            medians = [statistics.median(r[key] for r in results[n]) for n in names]
            cells = "   ".join(f"{spread([r[key] for r in results[n]]):<24}" for n in names)
            ratio = f"{medians[1] / medians[0]:.2f}" if medians[0] > 0 else "-"
            print(f"  {label:<{column}}  {cells}  {ratio}")
    key, bound = TARGETS[mode]
    what = dict(FIGURES[mode])[key].strip()
    for name in names:
        median = statistics.median(r[key] for r in results[name])
        verdict = "met" if median <= bound else "NOT met"
        whose = f" ({labels[name]})" if len(names) > 1 else ""
        print(f"  target: {what}, median <= {bound:g} ms{whose} -> {verdict} ({median:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--server", action="store_true",
                        help="server mode: PostgreSQL, Redis, a Celery worker, a host agent")  # fmt: skip
    parser.add_argument("--against", metavar="REV",
                        help="alternate rounds with REV's code (old) and the working tree's (new)")  # fmt: skip
    parser.add_argument("--rev", metavar="REV",
                        help="measure REV's code (new, with --against) instead of the working tree's")  # fmt: skip
    parser.add_argument("--side", choices=["standalone"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        standalone_side()
        return
    mode = "server" if args.server else "standalone"
    with contextlib.ExitStack() as stack:
        trees: dict[str, Path] = {}
        labels: dict[str, str] = {}
        if args.against:
            old, commit = stack.enter_context(worktree(args.against))
            trees["old"], labels["old"] = old, f"old ({commit})"
        trees["new"], labels["new"] = ROOT, "new (working tree)"
        if args.rev:
            new, new_commit = stack.enter_context(worktree(args.rev))
            trees["new"], labels["new"] = new, f"new ({new_commit})"
        sides: dict[str, Any] = {}
        for name, tree in trees.items():
            if mode == "server":
                from switch_server import ServerSide

                sides[name] = stack.enter_context(ServerSide(tree, name))
            else:
                sides[name] = ChildSide(tree)
                stack.callback(sides[name].close)
        results = run_rounds(sides, args.rounds)
        if mode == "server":
            print(f"switch to a parked model from outside, {args.rounds} rounds (server mode: "
                  "PostgreSQL, Redis, one Celery worker, one host agent over mutual TLS; "
                  "simulated GPU, park and wake 0 s in the engine)")  # fmt: skip
        else:
            print(f"switch to a parked model, {args.rounds} rounds (standalone, SQLite, "
                  "simulated GPU; the gateway's wake call, then the engine)")  # fmt: skip
        if args.against:
            print(f"  {labels['old']} and {labels['new']} alternating; "
                  "medians, 10th-90th percentile in brackets")  # fmt: skip
        elif args.rev:
            print(f"  the code of {args.rev} ({new_commit}); 10th-90th percentile in brackets")
        else:
            print("  10th-90th percentile in brackets")
        report(mode, results, labels)


if __name__ == "__main__":
    main()
