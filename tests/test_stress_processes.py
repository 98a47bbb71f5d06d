"""The stress of ``test_scheduler_stress.py`` with every actor a process of its own.

Four worker processes run a seeded random schedule of starts, wakes, parks and stops on
one host agent (joined over mutual TLS, two simulated 24 GiB GPUs, engines that keep
memory after a park, load slowly or hang on wake), beside a process doing reconcile passes
and one watching under the host lock. Each process has its own per-model locks and turn
waits: only the host lock, the conditional updates and the ledger keep them apart. On
SQLite the processes share one database file in standalone mode; on PostgreSQL they run in
server mode with a Redis of the test's own, as Celery workers do, beside a process holding
requests in flight on the ready models (as the gateway counts them): mid-run, while a
drain waits for one of them, Redis stops with ``SHUTDOWN SAVE`` and starts again on its
data 7 s later, so every lease lapses while the counts stay, and the process holding the
requests reaches it again 4 s after the others (it talks to Redis through a proxy the
test pauses); no model may be parked under a request counted in flight.

A failure names its seed: ``CAPYCTL_STRESS_SEED=N`` replays that schedule, and
``CAPYCTL_STRESS_STEPS`` makes a longer soak (outside CI).
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.runtime import free_port
from hostagent.simgpu import read_allocations
from tests.conftest import program_environment, run_program, run_programs, start_server, stop_server
from tests.own_servers import OwnRedis, PausableProxy
from tests.scheduling import SIM
from tests.test_hosts_join import start_agent
from tests.test_scheduler_stress import DOCUMENTED_CODES, PASSING
from tests.test_server_mode import start as start_api_server
from tests.test_server_mode import stop as stop_api_server

pytestmark = [pytest.mark.e2e, pytest.mark.database]

ENGINES = {
    "sim": {},
    "keeps": {"CAPYCTL_SIM_KEEP_MEMORY": "1"},
    "slow": {"CAPYCTL_SIM_LOAD_SECONDS": "0.5"},
    "hangs": {"CAPYCTL_SIM_HANG_ON_WAKE": "1"},
}
MODELS = [("sim", 16), ("keeps", 12), ("slow", 10), ("sim", 8), ("hangs", 8), ("sim", 6)]
WORKERS = 6
GPUS = "1x24GiB"
OUTAGE_SECONDS = 7.0  # past every lease (5 s), so the counts outlive them
LATE_SECONDS = 4.0  # the process holding requests is back this much later than the others


def _setup(env: dict[str, str]) -> None:
    """Engines and the six models, pinned to host ``box``, in one process."""
    commands = []
    for name, extra in ENGINES.items():
        env_args = []
        for key, value in {"CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB",
                           "CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB", **extra}.items():  # fmt: skip
            env_args += ["--env", f"{key}={value}"]
        commands.append(["engine", "add", name, "--kind", "vllm", "--command", f"{SIM} vllm",
                         *env_args])  # fmt: skip
    for i, (engine, gib) in enumerate(MODELS):
        commands.append(["deployment", "add", f"m{i}", "--engine", engine, "--host", "box",
                         "--source", f"m-{i}", "--gpu-memory", f"{gib}GiB",
                         "--wake-timeout", "3", "--min-ready-seconds", "0"])  # fmt: skip
    for result in run_programs(env, *commands):
        assert result.code == 0, result.err


def _joined_host(
    env: dict[str, str], tmp_path: Path, server_mode: bool
) -> tuple[subprocess.Popen[str], Path]:
    """Host ``box`` added and joined; its agent running (returned) and its sim dir."""
    enrol_port, agent_port = free_port(), free_port()
    env["CAPYCTL_ENROL_ADDRESS"] = f"127.0.0.1:{enrol_port}"
    added = run_program(env, "host", "add", "box", "--address", f"127.0.0.1:{agent_port}")
    assert added.code == 0, added.err
    token = added.out.split("--join ")[1].split()[0]
    if server_mode:
        server = start_api_server(env, tmp_path, free_port(), enrol_port)
    else:
        standalone = start_server(env, "--enrol-listen", f"127.0.0.1:{enrol_port}")
    try:
        agent = start_agent(env, tmp_path / "agent", agent_port, "--join", token,
                            gpus=GPUS)  # fmt: skip
        deadline = time.monotonic() + 60
        while not _polled(env):  # the server has read the host's GPUs
            assert time.monotonic() < deadline, "host box was not polled"
            time.sleep(0.2)
    finally:  # the agent needs nothing more of the server
        if server_mode:
            stop_api_server(server)
        else:
            stop_server(standalone, signal.SIGTERM)
    _setup(env)
    return agent, tmp_path / f"sim-{agent_port}"


def _polled(env: dict[str, str]) -> bool:
    hosts = json.loads(run_program(env, "host", "list", "--json").out)
    return any(h["name"] == "box" and h["state"] == "online" and h["gpus"] for h in hosts)


def _spawn(env: dict[str, str], tmp_path: Path, name: str, *argv: object) -> subprocess.Popen[str]:
    out = (tmp_path / f"{name}.out").open("w")
    err = (tmp_path / f"{name}.err").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.stress_worker", *map(str, argv)],
        env=env, stdout=out, stderr=err, text=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip


def _report(
    tmp_path: Path, name: str, process: subprocess.Popen[str], replay: str
) -> dict[str, Any]:
    code = process.wait()
    err = (tmp_path / f"{name}.err").read_text()
    assert code == 0, f"{name} exited with {code} {replay}:\n{err[-3000:]}"
    report: dict[str, Any] = json.loads((tmp_path / f"{name}.out").read_text())
    return report


def _status(env: dict[str, str]) -> list[tuple[str, str]]:
    listed = run_program(env, "deployment", "list", "--json")
    assert listed.code == 0, listed.err
    return [(d["name"], d["observed_state"]) for d in json.loads(listed.out)]


def _restart_with_data(redis: OwnRedis, late: PausableProxy, draining: Path) -> threading.Thread:
    """Redis stopped with ``SHUTDOWN SAVE`` once ``draining`` exists (a drain waits for a
    request held in flight, and polls the counts across the outage), and started again on
    its data ``OUTAGE_SECONDS`` later; what talks to it through ``late`` reaches it again
    ``LATE_SECONDS`` after that (on a thread, returned)."""

    def outage() -> None:
        deadline = time.monotonic() + 120
        while not draining.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        late.pause()
        redis.shutdown_save()
        time.sleep(OUTAGE_SECONDS)
        redis.start()
        time.sleep(LATE_SECONDS)
        late.resume()

    thread = threading.Thread(target=outage)
    thread.start()
    return thread


def test_worker_processes_on_one_agent_keep_the_ledger_true(tmp_path, own_redis):
    seed = int(os.environ.get("CAPYCTL_STRESS_SEED") or random.SystemRandom().randrange(10**6))
    steps = int(os.environ.get("CAPYCTL_STRESS_STEPS") or 20)
    replay = f"(seed {seed}: CAPYCTL_STRESS_SEED={seed} replays it)"
    with program_environment(tmp_path / "data") as env:
        server_mode = env.get("CAPYCTL_DATABASE_URL", "").startswith("postgres")
        if server_mode:
            env["CAPYCTL_REDIS_URL"] = own_redis.url
        agent, simdir = _joined_host(env, tmp_path, server_mode)
        try:
            names = [f"m{i}" for i in range(len(MODELS))]
            stopfile = tmp_path / "stop"
            watcher = _spawn(env, tmp_path, "watch", "watch", "box", simdir, stopfile)
            passes = _spawn(env, tmp_path, "reconcile", "reconcile", "box", stopfile)
            others = [watcher, passes]
            proxy = PausableProxy(own_redis.port)
            if server_mode:
                late = {**env, "CAPYCTL_REDIS_URL": proxy.url()}
                others.append(_spawn(late, tmp_path, "serve", "serve", seed, stopfile, *names))
            workers = [
                _spawn(env, tmp_path, f"work{n}", "work", seed, n, steps, *names)
                for n in range(WORKERS)
            ]
            draining = stopfile.with_name("draining")
            outage = _restart_with_data(own_redis, proxy, draining) if server_mode else None
            try:
                for process in workers:
                    process.wait(timeout=240)
            finally:
                if outage is not None:
                    outage.join()
                stopfile.touch()
                for process in [*others, *workers]:
                    try:
                        process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        process.kill()
                proxy.close()
            reports = [_report(tmp_path, f"work{n}", p, replay) for n, p in enumerate(workers)]
            errors = [e for r in reports for e in r["errors"]]
            assert errors == [], f"{replay}\n" + "\n".join(errors)
            codes = {code for r in reports for code in r["codes"]}
            outage_codes = {"control_plane_unavailable"} if server_mode else set()
            documented = DOCUMENTED_CODES | outage_codes
            assert codes <= documented, f"{codes} {replay}"
            if server_mode:
                served = _report(tmp_path, "serve", others[2], replay)
                assert served["errors"] == [], f"{served['errors'][:5]} {replay}"
                assert served["outages"] >= 1, "the requests in flight never saw Redis away"
                assert served["drains_waited"] >= 1, "no drain waited for a request in flight"
                assert served["served"] >= 5, served
            done = sum(sum(r["done"].values()) for r in reports)
            refused = [r["codes"] for r in reports]
            assert done >= WORKERS * steps // 4, f"{done} done, refused: {refused} {replay}"
            reconciled = _report(tmp_path, "reconcile", passes, replay)
            assert reconciled["errors"] == [], replay
            assert reconciled["passes"] >= 3, replay
            watched = _report(tmp_path, "watch", watcher, replay)
            assert watched["looks"] >= 10, f"the watcher looked {watched['looks']} times"
            assert watched["found"] == [], f"{watched['found'][:10]} {replay}"
            _settles(env, simdir, replay)
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)


def _settles(env: dict[str, str], simdir: Path, replay: str) -> None:
    """Nothing left passing (a hung wake ends at its timeout, a pass repairs what is
    stuck); no overshoot ever recorded; the ledger then counts what the device holds."""
    deadline = time.monotonic() + 60
    while True:
        passing = [(n, s) for n, s in _status(env) if s in PASSING]
        if not passing:
            break
        assert time.monotonic() < deadline, f"still passing: {passing} {replay}"
        time.sleep(0.5)
    events = json.loads(run_program(env, "events", "--json", "--limit", "1000").out)
    overshoots = [e["message"] for e in events if e["kind"] == "ledger.overshoot"]
    assert overshoots == [], f"{overshoots} {replay}"
    deadline = time.monotonic() + 30
    while True:
        status = json.loads(run_program(env, "status", "--json").out)
        pools = {p["pool"]: p for h in status["hosts"] if h["name"] == "box" for p in h["pools"]}
        on_device: dict[int, int] = {}
        for allocation in read_allocations(simdir):
            for index, used in allocation.gpu.items():
                on_device[index] = on_device.get(index, 0) + used
        gpus = [int(p.removeprefix("gpu")) for p in pools if p.startswith("gpu")]
        counted = {
            i: sum(pools[f"gpu{i}"][f"{k}_bytes"] for k in ("held", "promised", "unconfirmed"))
            for i in gpus
        }
        if counted == {i: on_device.get(i, 0) for i in gpus}:
            return
        assert time.monotonic() < deadline, f"ledger {counted}, device {on_device} {replay}"
        time.sleep(0.5)
