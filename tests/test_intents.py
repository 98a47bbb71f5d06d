"""`capyctl deployment start|stop|park|wake` and `capyctl events` against a running
standalone server with simulated GPUs and engines, as a user runs them."""

import json
import signal
import sys

import httpx
import psutil
import pytest

from tests.conftest import run_program, start_server, stop_server
from tests.waiting import wait_until
from tests.watching import Watcher

pytestmark = pytest.mark.e2e

SIM = f"{sys.executable} -m hostagent.sim"


def sim_children(server):
    return [
        p for p in psutil.Process(server.process.pid).children(recursive=True)
        if "hostagent.sim" in " ".join(p.cmdline())
    ]  # fmt: skip


def test_intents_drive_the_running_server(program_env):
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm",
               "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=8GiB").code == 0  # fmt: skip
    for name in ("a", "b"):
        added = run("deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
                    "--gpu-memory", "16GiB")  # fmt: skip
        assert added.code == 0, added.err

    parked = run("deployment", "park", "a")
    assert parked.code == 2
    assert "no CapyCTL server is running" in parked.err

    server = start_server(program_env)
    try:
        started = run("deployment", "start", "a")
        assert started.code == 0, started.err
        assert started.out.startswith("a is ready (")
        switched = run("deployment", "wake", "b")
        assert switched.code == 0, switched.err
        assert switched.out.startswith("b is ready")
        listed = {d["name"]: d for d in json.loads(run("deployment", "list", "--json").out)}
        assert (listed["a"]["observed_state"], listed["a"]["parked_mode"]) == ("parked", "ram")
        assert len(sim_children(server)) == 2

        deep = run("deployment", "park", "b", "--mode", "deep")
        assert deep.code == 0, deep.err
        assert deep.out.startswith("b is parked (deep)")

        stopped = run("deployment", "stop", "a")
        assert stopped.out.startswith("a is stopped")
        woken = run("deployment", "wake", "a")
        assert woken.code == 1
        assert "a is stopped; start it first" in woken.err

        status = json.loads(run("status", "--json").out)
        gpu0 = next(p for p in status["hosts"][0]["pools"] if p["pool"] == "gpu0")
        assert gpu0["used_bytes"] <= gpu0["capacity_bytes"]

        events = run("events", "--limit", "40").out
        assert "parked a (ram) to make room for b" in events
        assert "deployment.ready" in events
        assert "stopped on request" in events
        children = sim_children(server)
    finally:
        seconds = stop_server(server, signal.SIGTERM)
    assert seconds < 5
    # The server ended its engines before it exited; an engine's own children may take a
    # moment more to be reaped.
    wait_until(
        lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children),
        "the engines to be gone",
        timeout=5,
    )
    after = {d["name"]: d for d in json.loads(run("deployment", "list", "--json").out)}
    assert after["b"]["observed_state"] == "stopped"
    assert "CapyCTL stopped" in run("events", "--model", "b").out


def test_concurrent_intents_from_several_processes_never_overcommit(program_env, tmp_path):
    """Several `capyctl` processes ask at once; the server's threads carry the operations
    out; an observer checks every pool all along; the ledger ends agreeing with the probe."""
    import random
    import subprocess

    program_env["CAPYCTL_SIM_GPUS"] = "24GiB,24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    program_env["CAPYCTL_SIM_STATE_DIR"] = str(tmp_path / "sim")
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    names = [f"m{i}" for i in range(5)]
    for name, gib in zip(names, (16, 12, 10, 8, 6), strict=True):
        assert run("deployment", "add", name, "--engine", "sim", "--source", "m",
                   "--gpu-memory", f"{gib}GiB").code == 0  # fmt: skip

    key = run("key", "create", "--user", "admin", "--admin").out.strip()
    server = start_server(program_env)

    def look() -> list[str]:
        """Every pool, as the REST API reports it (a cheap read, many times a second)."""
        answer = httpx.get(
            f"{server.base_url}/api/hosts/", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        answer.raise_for_status()
        return [
            f"{pool['pool']}: {pool['used_bytes']}"
            for host in answer.json()["results"]
            for pool in host["pools"]
            if pool["used_bytes"] > pool["capacity_bytes"]
        ]

    try:
        scripts = []
        for seed in range(3):
            rng = random.Random(seed)  # noqa: S311 - a seeded, repeatable schedule
            steps = [
                (rng.choice(["start", "wake", "wake", "park", "stop"]), rng.choice(names))
                for _ in range(6)
            ]
            scripts.append(steps)
        with Watcher(look) as watcher:
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", _INTENT_SCRIPT, json.dumps(steps)],
                    env=program_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for steps in scripts
            ]
            outputs = [p.communicate(timeout=240)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs
        assert watcher.verify(min_looks=10) == []
        from hostagent.probe import SimulatedProbe
        from hostagent.simgpu import parse_sim_gpus

        probe = SimulatedProbe(parse_sim_gpus("24GiB,24GiB"), tmp_path / "sim")

        def disagreements() -> list[tuple[str, int, int]]:
            """Pools where the ledger's count differs from what the probe reads."""
            ledger = json.loads(run("status", "--json").out)["ledger"]
            return [
                (f"gpu{r.index}", counted, r.used_bytes)
                for r in probe.devices()
                if (counted := sum(e["bytes"] for e in ledger if e["pool"] == f"gpu{r.index}"))
                != r.used_bytes
            ]

        # What the last operations left unconfirmed, a reconcile pass settles.
        wait_until(lambda: not disagreements(), "the ledger to agree with the probe")
    finally:
        stop_server(server, signal.SIGTERM)


# Run by each intent process: a list of (action, model) through the real CLI entry point.
_INTENT_SCRIPT = """
import json, sys
from capyctl.cli import run
for action, name in json.loads(sys.argv[1]):
    code = run(["deployment", action, name, "--timeout", "120"])
    print(action, name, code, flush=True)
    if code not in (0, 1):
        sys.exit(code)
"""
