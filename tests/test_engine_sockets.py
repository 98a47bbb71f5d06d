"""Engines that can listen on a Unix socket are launched there, in their own 0700 run dir,
and spoken to there: no TCP port another local user could reach (vLLM's sleep routes are
not behind its key). Health, park, wake, warm-up and /v1 go over the socket, in process and
through a joined host's relay; a build without socket support listens on loopback."""

import asyncio
import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest
from aiohttp import web

from capyctl.gateway.upstream import UpstreamPool, unix_url
from hostagent.kinds import get_kind
from hostagent.kinds.base import LaunchSpec
from hostagent.probe import CpuOnlyProbe, SimulatedProbe
from hostagent.runtime import EngineRuntime, Instance, InstanceRequest
from hostagent.sim.identity import NO_SOCKET_ENV
from hostagent.simgpu import SimSpec
from hostagent.versions import EngineFeatures, EngineFlagError
from tests.conftest import run_program, start_server, stop_server
from tests.engine_http import engine_http
from tests.test_hosts_join import joined, wait_online  # noqa: F401 - a fixture

GIB = 1024**3
SIM = f"{sys.executable} -m hostagent.sim"
MEMORY = {"CAPYCTL_SIM_GPU_BYTES": "8GiB", "CAPYCTL_SIM_WEIGHTS_BYTES": "4GiB"}
NOBODY = 65534
# What another local user runs: the system's Python (a root-only venv may not be theirs).
CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "try:\n"
    "    s.connect(sys.argv[1])\n"
    "    s.sendall(b'GET /is_sleeping HTTP/1.0\\r\\n\\r\\n')\n"
    "    print('answered', s.recv(200))\n"
    "except OSError as exc:\n"
    "    print('refused', exc)\n"
)


@pytest.fixture
def runtime(tmp_path):
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB]), tmp_path / "sim")
    return EngineRuntime(probe, tmp_path / "logs", release_timeout=2.0)


@pytest.fixture
def launched(runtime):
    instances: list[Instance] = []

    def launch(kind: str, **env: str) -> Instance:
        request = InstanceRequest(
            instance_id=f"{kind}-{uuid.uuid4().hex[:6]}",
            kind=kind,
            command=f"{SIM} {kind}",
            source=f"/models/{kind}",
            served_name=f"{kind}-model",
            gpu_indices=[0],
            env={**MEMORY, **env},
        )
        instance: Instance = runtime.launch(request)
        instances.append(instance)
        runtime.wait_ready(instance, timeout=30)
        return instance

    yield launch
    for instance in instances:
        runtime.stop(instance, grace_seconds=2)


def tcp_listeners(pid: int) -> list[str]:
    """Every TCP port the engine's process tree listens on, on any address."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [
        f"{conn.laddr.ip}:{conn.laddr.port}"
        for proc in tree
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]


def as_another_user(path: Path) -> str:
    """What ``nobody`` gets when it tries to open the socket and ask it something."""
    done = subprocess.run(
        ["/usr/bin/python3", "-c", CONNECT, str(path)],
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.stdout + done.stderr


def assert_private_socket(instance: Instance) -> Path:
    path = instance.socket_path
    assert path is not None
    assert instance.port == 0
    assert stat.S_ISSOCK(path.stat().st_mode)
    folder = path.parent.stat()
    assert stat.S_IMODE(folder.st_mode) == 0o700
    assert folder.st_uid == os.geteuid()
    assert tcp_listeners(instance.pid) == []  # nothing on any TCP port, loopback included
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_a_local_user_cannot_reach_a_vllm_engine_on_its_socket(runtime, launched, tmp_path):
    instance = launched("vllm")
    path = assert_private_socket(instance)
    assert path.parent == tmp_path / "run" / instance.request.instance_id  # its run dir
    refused = as_another_user(path)
    assert refused.startswith("refused"), refused
    assert "Permission denied" in refused
    # CapyCTL itself goes on over the socket: a request, a park, a wake.
    chat = {"model": "vllm-model", "messages": [{"role": "user", "content": "hi"}]}
    client = engine_http(instance, headers={"Authorization": f"Bearer {instance.api_key}"})
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert runtime.park(instance, "ram").gpu == {0: 256 * 1024**2}
    assert runtime.asleep(instance) is True
    runtime.wake(instance, "ram", timeout=30)
    assert runtime.asleep(instance) is False
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    runtime.stop(instance, grace_seconds=2)
    assert not path.parent.exists()


def test_builds_without_socket_support_listen_on_loopback(launched):
    old_vllm = launched("vllm", **{NO_SOCKET_ENV: "1"})  # its help lists no --uds
    sglang = launched("sglang")  # SGLang 0.5.23: no --uds either
    old_llama = launched("llamacpp", **{NO_SOCKET_ENV: "1"})  # its --host binds no socket
    for instance in (old_vllm, sglang, old_llama):
        assert instance.socket_path is None
        assert instance.port > 0
        assert tcp_listeners(instance.pid) == [f"127.0.0.1:{instance.port}"]
        assert engine_http(instance).get("/health").status_code == 200
    llama = launched("llamacpp")  # one whose --host says it binds .sock paths
    assert_private_socket(llama)
    assert engine_http(llama).get("/health").json() == {"status": "ok"}


def test_sglang_with_uds_is_given_the_socket_and_no_host_or_port(tmp_path):
    """SGLang's --uds refuses a --host or --port other than their defaults beside it."""
    kind = get_kind("sglang")
    features = EngineFeatures(version="main", flags=frozenset({"--uds", "--host", "--port"}))
    assert kind.socket_listening(features)
    assert not kind.socket_listening(EngineFeatures(version="0.5.23", flags=frozenset()))
    spec = LaunchSpec(command="sglang serve", source="/m", served_name="m", port=0,
                      api_key="k", run_dir=tmp_path, features=features,
                      socket_path=tmp_path / "engine.sock")  # fmt: skip
    argv = kind.build_launch(spec).argv
    assert argv[argv.index("--uds") + 1] == str(tmp_path / "engine.sock")
    assert "--host" not in argv
    assert "--port" not in argv


def test_a_run_dir_too_deep_for_a_socket_path_gets_a_short_private_one(tmp_path, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 4)
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB]), tmp_path / "sim")
    runtime = EngineRuntime(probe, deep / "logs", release_timeout=2.0)
    request = InstanceRequest(instance_id=f"vllm-{uuid.uuid4().hex}", kind="vllm",
                              command=f"{SIM} vllm", source="/m", served_name="m",
                              gpu_indices=[0], env=MEMORY)  # fmt: skip
    with pytest.raises(EngineFlagError):  # a launch refused leaves no folder behind
        runtime.launch(dataclasses.replace(request, extra_args=["--no-such-flag"]))
    assert list(temporary.iterdir()) == []
    instance = runtime.launch(request)
    try:
        runtime.wait_ready(instance, timeout=30)
        path = assert_private_socket(instance)
        assert path.parent.parent == temporary
        assert len(bytes(path)) <= 107 < len(bytes(deep / "run" / request.instance_id / "x"))
    finally:
        runtime.stop(instance, grace_seconds=2)
    assert not path.parent.exists()


def test_the_gateways_upstream_pool_speaks_over_a_unix_socket(tmp_path):
    async def scenario() -> tuple[list[bytes], int]:
        async def hello(request: web.Request) -> web.Response:
            return web.Response(text=f"{request.path} {request.headers['Host']}")

        app = web.Application()
        app.router.add_get("/v1/{rest:.*}", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        path = tmp_path / "engine.sock"
        await web.UnixSite(runner, str(path)).start()
        pool = UpstreamPool()
        try:
            bodies = []
            for _ in range(2):
                async with await pool.request("GET", f"{unix_url(str(path))}/v1/models") as r:
                    bodies.append(await r.read())
            return bodies, pool.idle_count()
        finally:
            await pool.close()
            await runner.cleanup()

    bodies, idle = asyncio.run(scenario())
    assert bodies == [b"/v1/models localhost"] * 2
    assert idle == 1  # one kept-alive connection, reused


async def gateway_burst(path: Path, count: int) -> list[bytes]:
    """``count`` requests at once through the gateway's upstream pool."""
    pool = UpstreamPool()

    async def one() -> bytes:
        async with await pool.request("GET", f"{unix_url(str(path))}/health") as response:
            return await response.read()

    try:
        return list(await asyncio.gather(*(one() for _ in range(count))))
    finally:
        await pool.close()


async def relay_burst(path: Path, count: int) -> list[bytes]:
    """``count`` requests at once through the host agent's relay's client."""
    from hostagent.agent import PatientUnixConnector

    connector = PatientUnixConnector(path=str(path), limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> bytes:
            async with session.get("http://localhost/health") as response:
                return await response.read()

        return list(await asyncio.gather(*(one() for _ in range(count))))


@pytest.mark.parametrize("burst", [gateway_burst, relay_burst], ids=["gateway", "relay"])
def test_a_full_accept_queue_on_the_socket_is_waited_for_as_tcp_would(tmp_path, burst):
    """A Unix socket whose accept queue is full refuses a connect at once (EAGAIN) where
    TCP would retry: a burst of new connections must wait for the engine, not fail."""
    import threading

    import uvloop

    path = tmp_path / "engine.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)  # the engine is busy: one waits in its queue, the rest are refused
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"

    def serve_later() -> None:
        time.sleep(0.5)
        for _ in range(8):
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    try:
        assert uvloop.run(burst(path, 8)) == [b"ok"] * 8  # the gateway's and agent's loop
    finally:
        thread.join(timeout=10)
        server.close()


# --- end to end: standalone, and through a joined host's relay ---------------------------------


def engines_of(data_dir: Path) -> list[psutil.Process]:
    """The simulated engines launched by the CapyCTL whose data dir is ``data_dir``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "hostagent.sim" in cmdline and any(str(data_dir) in arg for arg in cmdline):
            found.append(proc)
    return found


def chat_through(base_url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=60,
    )


def states(env: dict[str, str]) -> dict[str, tuple[str, str]]:
    rows = json.loads(run_program(env, "deployment", "list", "--json").out)
    return {d["name"]: (d["observed_state"], d["parked_mode"] or "") for d in rows}


def check_private_engine(data_dir: Path) -> None:
    (engine,) = engines_of(data_dir)
    cmdline = engine.cmdline()
    path = Path(cmdline[cmdline.index("--uds") + 1])
    assert path.parent.parent == data_dir / "run"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert tcp_listeners(engine.pid) == []
    if os.geteuid() == 0:
        assert "Permission denied" in as_another_user(path)


@pytest.mark.e2e
def test_standalone_serves_parks_and_wakes_a_vllm_on_its_socket(program_env):
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    added = run(
        "deployment", "add", "a", "--engine", "sim", "--source", "m", "--gpu-memory", "8GiB"
    )
    assert added.code == 0, added.err
    key = run("key", "create", "--user", "admin").out.strip()
    server = start_server(program_env)
    try:
        answer = chat_through(server.base_url, key, "a")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
        check_private_engine(Path(program_env["CAPYCTL_DATA_DIR"]))
        assert run("deployment", "park", "a", "--mode", "ram").code == 0
        assert states(program_env)["a"] == ("parked", "ram")
        assert chat_through(server.base_url, key, "a").status_code == 200  # woken by it
        assert states(program_env)["a"] == ("ready", "")
    finally:
        stop_server(server, signal.SIGTERM)


@pytest.mark.e2e
def test_a_joined_hosts_relay_reaches_its_engine_on_its_socket(joined):  # noqa: F811
    env, _, _, agent_dir, _, base_url = joined
    wait_online(env, "gpu1")
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    added = run("deployment", "add", "r", "--engine", "sim", "--host", "gpu1", "--source", "m",
                "--gpu-memory", "8GiB", "--gpus", "1")  # fmt: skip
    assert added.code == 0, added.err
    key = run("key", "create", "--user", "admin").out.strip()
    answer = chat_through(base_url, key, "r")
    assert answer.status_code == 200, answer.text
    check_private_engine(agent_dir)
    streamed = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "r", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=60,
    )
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert run("deployment", "park", "r", "--mode", "ram").code == 0
    assert states(env)["r"] == ("parked", "ram")
    assert run("deployment", "wake", "r").code == 0
    assert chat_through(base_url, key, "r").status_code == 200


# --- the real llama-server ---------------------------------------------------------------------


def test_the_real_llama_server_listens_on_its_socket(tmp_path):
    from tests.test_llama_server import request_for_smollm

    runtime = EngineRuntime(CpuOnlyProbe(), tmp_path / "logs")
    instance = runtime.launch(request_for_smollm())
    try:
        assert instance.spec.features is not None
        assert instance.spec.features.can("unix-socket"), instance.spec.features
        runtime.wait_ready(instance, timeout=120)
        path = assert_private_socket(instance)
        if os.geteuid() == 0:
            assert "Permission denied" in as_another_user(path)
        answer = engine_http(instance, headers={"Authorization": f"Bearer {instance.api_key}"},
                             timeout=60).post(
            "/v1/chat/completions",
            json={"model": "smollm", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
    finally:
        runtime.stop(instance, grace_seconds=5)
