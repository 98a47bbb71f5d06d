"""Server mode for real: PostgreSQL, Redis, `capyctl start server` (api + Celery worker),
and a host agent joined over mutual TLS with a simulated GPU."""

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest

from hostagent.runtime import free_port
from hostagent.simgpu import read_allocations
from tests.conftest import CAPYCTL, run_program
from tests.test_hosts_join import start_agent

pytestmark = pytest.mark.e2e

PG = "postgres://postgres@127.0.0.1:5432"
SIM = f"{sys.executable} -m hostagent.sim vllm"


def server_env_for(tmp_path, database_url, redis_url):
    """A server's environment: this one without CAPYCTL_*, then the server's own."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env.update(
        CAPYCTL_DATA_DIR=str(tmp_path / "server"),
        CAPYCTL_DATABASE_URL=database_url,
        CAPYCTL_REDIS_URL=redis_url,
        CAPYCTL_MIN_READY_SECONDS="0",
        PYTHONUNBUFFERED="1",
    )
    return env


@contextmanager
def server_database_env(tmp_path, redis_url, prefix="capyctl_server"):
    """The environment of a server with a PostgreSQL database of its own (dropped after)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server_env_for(tmp_path, f"{PG}/{name}", redis_url)
    finally:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def server_env(tmp_path, redis_url):
    with server_database_env(tmp_path, redis_url) as env:
        yield env


def start(env, tmp_path, port, enrol_port):
    log = (tmp_path / f"server-{port}.log").open("w")
    process = subprocess.Popen(
        [CAPYCTL, "start", "server", "--listen", f"127.0.0.1:{port}",
         "--enrol-listen", f"127.0.0.1:{enrol_port}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / f"server-{port}.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")


def stop(process):
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()


def rest(port, key, path):
    """One REST read: cheaper than a ``capyctl`` process where the CLI is not the point."""
    answer = httpx.get(
        f"http://127.0.0.1:{port}/api/{path}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body["results"] if isinstance(body, dict) and "results" in body else body


def wait_for(condition, what, timeout=60):
    """Wait until ``condition()`` holds, with a bound generous for a loaded machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def wait_online(port, key, count=1):
    def online():
        return sum(h["state"] == "online" for h in rest(port, key, "hosts/")) >= count

    wait_for(online, f"{count} host(s) online")


def one_host_setup(env):
    """Ports for the server, its enrolment and one agent; host ``box`` added; its token."""
    ports = (free_port(), free_port(), free_port())
    env["CAPYCTL_ENROL_ADDRESS"] = f"127.0.0.1:{ports[1]}"
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    added = run("host", "add", "box", "--address", f"127.0.0.1:{ports[2]}")
    assert added.code == 0, added.err
    return env, run, ports, added.out.split("--join ")[1].split()[0]


def test_server_mode_needs_postgresql_and_redis(program_env, redis_url):
    no_redis = run_program({**program_env, "CAPYCTL_MODE": "server"}, "status")
    assert no_redis.code == 2
    assert "server mode needs CAPYCTL_REDIS_URL" in no_redis.err
    sqlite_url = f"sqlite:///{program_env['CAPYCTL_DATA_DIR']}/x.db"
    on_sqlite = {**program_env, "CAPYCTL_REDIS_URL": redis_url, "CAPYCTL_DATABASE_URL": sqlite_url}
    sqlite = run_program(on_sqlite, "status")
    assert sqlite.code == 2
    assert "server mode needs PostgreSQL" in sqlite.err
    dead = {**program_env, "CAPYCTL_REDIS_URL": "redis://127.0.0.1:1/0",
            "CAPYCTL_DATABASE_URL": f"{PG}/postgres"}  # fmt: skip
    refused = run_program(dead, "start", "server", "--listen", f"127.0.0.1:{free_port()}")
    assert refused.code == 2
    assert "Redis does not answer at redis://127.0.0.1:1/0" in refused.err
    assert len(refused.err.strip().splitlines()) == 1


def hosts_setup(env, *names):
    """Ports for the server and its enrolment; hosts ``names`` added, each with a port for
    its agent and its join token; the engine ``sim`` added."""
    port, enrol_port = free_port(), free_port()
    env["CAPYCTL_ENROL_ADDRESS"] = f"127.0.0.1:{enrol_port}"
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    ports = {name: free_port() for name in names}
    tokens = {}
    for name, agent_port in ports.items():
        added = run("host", "add", name, "--address", f"127.0.0.1:{agent_port}")
        assert added.code == 0, added.err
        tokens[name] = added.out.split("--join ")[1].split()[0]
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", SIM,
               "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=2GiB").code == 0  # fmt: skip
    return run, port, enrol_port, ports, tokens


def two_models(run):
    """Models ``a`` and ``b`` (16 GiB each, 2 GiB weights) on host ``box``; an admin key."""
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", SIM,
               "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=2GiB").code == 0  # fmt: skip
    for name in ("a", "b"):
        added = run("deployment", "add", name, "--engine", "sim", "--host", "box", "--source",
                    f"m-{name}", "--gpu-memory", "16GiB", "--weights-size", "2GiB")  # fmt: skip
        assert added.code == 0, added.err
    return run("key", "create", "--user", "admin", "--admin").out.strip()


def gated_model(run, gate, *, wake_timeout):
    """Model ``a`` on host ``box`` whose engine holds each wake until ``gate`` exists (and
    says so with ``gate.waiting``); an admin key."""
    assert run("engine", "add", "slow", "--kind", "vllm", "--command", SIM,
               "--env", f"CAPYCTL_SIM_WAKE_GATE={gate}",
               "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=2GiB").code == 0  # fmt: skip
    assert run("deployment", "add", "a", "--engine", "slow", "--host", "box", "--source", "m-a",
               "--gpu-memory", "16GiB", "--weights-size", "2GiB",
               "--wake-timeout", str(wake_timeout)).code == 0  # fmt: skip
    return run("key", "create", "--user", "admin", "--admin").out.strip()


def chat(port, key, model, timeout=60.0):
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=timeout,
    )


def agent_sim_dir(tmp_path, agent_port):
    """Where the agent started by ``start_agent`` keeps its simulated GPUs' allocations."""
    return tmp_path / f"sim-{agent_port}"


def assert_ledger_is_the_device(run, sim_dir, host="local"):
    """Once things settle, the ledger counts on each GPU what the simulated device shows
    the engines holding there: nothing promised, unconfirmed or foreign left over."""

    deadline = time.monotonic() + 60
    while True:
        status = json.loads(run("status", "--json").out)
        pools = {p["pool"]: p for h in status["hosts"] if h["name"] == host for p in h["pools"]}
        on_device = sum(a.gpu.get(0, 0) for a in read_allocations(sim_dir))
        gpu = pools["gpu0"]
        counted = {k: gpu[f"{k}_bytes"] for k in ("held", "promised", "unconfirmed", "foreign")}
        if counted == {"held": on_device, "promised": 0, "unconfirmed": 0, "foreign": 0}:
            return
        assert time.monotonic() < deadline, f"ledger {counted}, on the device {on_device}"
        time.sleep(0.5)


def test_requests_wake_models_on_workers_and_a_restart_recovers(server_env, tmp_path):
    env, run, (port, enrol_port, agent_port), token = one_host_setup(server_env)
    key = two_models(run)
    server = start(env, tmp_path, port, enrol_port)
    agent = start_agent(env, tmp_path / "agent", agent_port, "--join", token, gpus="24GiB")
    try:
        wait_online(port, key)

        def ask(model):
            return chat(port, key, model)

        # a starts on a worker for the first request; b then takes the 24 GiB GPU from it.
        first = ask("a")
        assert first.status_code == 200, first.text
        switched = ask("b")
        assert switched.status_code == 200, switched.text
        # What the worker switched for it, told with its outcome.
        told = switched.headers["x-capyctl-switch"]
        assert re.fullmatch(r"parked a \(ram\) \d+ ms; started b \d+ ms", told), told
        rows = {d["name"]: d for d in json.loads(run("deployment", "list", "--json").out)}
        assert (rows["a"]["observed_state"], rows["a"]["parked_mode"]) == ("parked", "ram")
        assert rows["b"]["observed_state"] == "ready"
        # An intent from the CLI is carried out by a worker too.
        parked = run("deployment", "park", "b")
        assert parked.code == 0, parked.err
        assert "b is parked" in parked.out

        # A restart of the server: PostgreSQL holds the truth; nothing is left half-done.
        assert stop(server) == 0
        server = start(env, tmp_path, port, enrol_port)
        rows = {d["name"]: d for d in json.loads(run("deployment", "list", "--json").out)}
        assert {r["observed_state"] for r in rows.values()} <= {"ready", "parked", "stopped"}
        again = ask("a")  # the engines lived on with their agent: a is woken, not started
        assert again.status_code == 200, again.text
        events = run("events", "--model", "a", "--limit", "50").out
        assert events.count("deployment.starting") == 1
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        stop(server)
    assert Path(tmp_path / "agent" / "agent.crt").exists()


def test_two_hosts_with_different_gpus_switch_apart(server_env, tmp_path):
    env = server_env
    run, port, enrol_port, ports, tokens = hosts_setup(env, "small", "big")
    placed = {"s1": ("small", "16GiB"), "s2": ("small", "16GiB"), "b1": ("big", "40GiB")}
    for name, (host, size) in placed.items():
        added = run("deployment", "add", name, "--engine", "sim", "--host", host, "--source",
                    f"m-{name}", "--gpu-memory", size, "--weights-size", "2GiB")  # fmt: skip
        assert added.code == 0, added.err
    key = run("key", "create", "--user", "admin", "--admin").out.strip()
    server = start(env, tmp_path, port, enrol_port)
    agents = [
        start_agent(env, tmp_path / "small", ports["small"], "--join", tokens["small"],
                    gpus="24GiB"),
        start_agent(env, tmp_path / "big", ports["big"], "--join", tokens["big"],
                    gpus="80GiB"),
    ]  # fmt: skip
    try:
        wait_online(port, key, count=2)

        def ask(model):
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text

        def states():
            rows = json.loads(run("deployment", "list", "--json").out)
            return {d["name"]: (d["observed_state"], d["parked_mode"] or "") for d in rows}

        for model in ("b1", "s1", "s2"):
            ask(model)
        # s2 took the small host's GPU from s1; b1, on the big host, was left alone.
        assert states() == {"s1": ("parked", "ram"), "s2": ("ready", ""), "b1": ("ready", "")}
        ledger = json.loads(run("status", "--json").out)["ledger"]
        held = {(e["host"], e["deployment"], e["pool"]) for e in ledger if e["deployment"]}
        assert ("big", "b1", "gpu0") in held
        assert ("small", "s2", "gpu0") in held
        assert ("small", "s1", "gpu0") in held  # its residual after the park
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
        stop(server)


def test_a_worker_killed_mid_wake_leaves_nothing_half_done(server_env, tmp_path):
    import threading

    import psutil

    env, run, (port, enrol_port, agent_port), token = one_host_setup(server_env)
    gate = tmp_path / "wake-gate"  # the engine holds each wake until this file exists
    key = gated_model(run, gate, wake_timeout=10)
    server = start(env, tmp_path, port, enrol_port)
    agent = start_agent(env, tmp_path / "agent", agent_port, "--join", token, gpus="24GiB")

    def state():
        return rest(port, key, "deployments/a/")["observed_state"]

    def ask():
        return httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "a", "messages": [{"role": "user", "content": "hi"}]},
            timeout=120,
        )

    try:
        wait_online(port, key)
        assert run("deployment", "start", "a").code == 0
        assert run("deployment", "park", "a").code == 0
        answers: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answers.append(ask()))
        asking.start()
        # The engine has the wake and holds it: the worker is inside the wake, for as long
        # as the test likes.
        wait_for(gate.with_name("wake-gate.waiting").exists, "the engine to receive the wake")
        assert state() == "waking"
        workers = [p for p in psutil.Process(server.pid).children()
                   if "worker" in " ".join(p.cmdline())]  # fmt: skip
        assert workers
        for worker in workers:
            worker.kill()  # mid-wake: no warm shutdown, no acknowledgement
        asking.join(timeout=90)
        assert answers, "the request was left hanging"
        # Its wake timeout, or the pass that found nobody driving the wake any more (the
        # killed worker's lease lapsed) and failed it: whichever came first.
        assert (answers[0].status_code, answers[0].json()["error"]["code"]) in (
            (504, "wake_timeout"),
            (502, "engine_failed"),
        ), answers[0].text
        # No deployment stays waking past its timeout: the pass repairs it (failed), and
        # the next request starts it again on the worker the supervisor started anew.
        # The pass claims it as stopping while it ends the engine, then fails it.
        wait_for(lambda: state() not in ("waking", "stopping"), "the pass to repair a")
        assert state() == "failed"
        gate.touch()  # from here on wakes go through (the next request starts a anew)
        again = ask()
        assert again.status_code == 200, (again.text, run("events", "--limit", "15").out)
        assert state() == "ready"
        status = json.loads(run("status", "--json").out)
        mine = [e for e in status["ledger"] if e["deployment"] == "a"]
        assert {e["status"] for e in mine} <= {"held"}  # nothing promised or unknown left
        assert len({e["pool"] for e in mine}) == len(mine)  # one entry a pool
        assert_ledger_is_the_device(run, agent_sim_dir(tmp_path, agent_port), host="box")
    finally:
        gate.touch()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        stop(server)


def test_a_host_drain_moves_a_model_to_the_other_host_without_a_failed_request(
    server_env, tmp_path
):
    """Two hosts joined over mutual TLS; `chat` placed on one of them serves a steady
    stream of requests while that host is drained: it finishes its requests, stops and
    starts on the other host; every request gets its answer (some wait for the start)."""
    import threading

    env = server_env
    run, port, enrol_port, ports, tokens = hosts_setup(env, "one", "two")
    assert run("deployment", "add", "chat", "--engine", "sim", "--source", "m-chat",
               "--gpu-memory", "16GiB", "--weights-size", "2GiB").code == 0  # fmt: skip
    key = run("key", "create", "--user", "admin", "--admin").out.strip()
    server = start(env, tmp_path, port, enrol_port)
    agents = [
        start_agent(env, tmp_path / name, agent_port, "--join", tokens[name], gpus="24GiB")
        for name, agent_port in ports.items()
    ]
    try:
        wait_online(port, key, count=2)
        assert chat(port, key, "chat").status_code == 200

        def host_of() -> tuple[str, str]:
            (row,) = rest(port, key, "deployments/")
            return row["host"], row["observed_state"]

        placed, _ = host_of()
        other = ({"one", "two"} - {placed}).pop()
        answers: list[int] = []
        stop_load = threading.Event()

        def load() -> None:
            while not stop_load.is_set():
                answers.append(chat(port, key, "chat", timeout=120).status_code)

        loader = threading.Thread(target=load)
        loader.start()
        try:
            time.sleep(0.5)
            drained = run("host", "drain", placed)
            assert drained.code == 0, drained.err
            wait_for(lambda: host_of() == (other, "ready"), f"chat ready on {other}", 120)
            events = json.loads(run("events", "--json", "--limit", "200").out)
            kinds = {e["kind"] for e in events}
            wait_for(lambda: any(e["kind"] == "host.drained" for e in json.loads(
                run("events", "--json", "--limit", "200").out)), "host.drained", 60)  # fmt: skip
            time.sleep(0.5)  # a few requests on the new host too
        finally:
            stop_load.set()
            loader.join(timeout=130)
        assert len(answers) > 3
        assert set(answers) == {200}, answers
        assert "deployment.stopped" in kinds
        hosts = {h["name"]: h for h in rest(port, key, "hosts/")}
        assert hosts[placed]["draining"] is True
        assert hosts[other]["draining"] is False
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=15)
        stop(server)
