"""Each simulated kind driven the way the scheduler drives a real engine, with the probe's
per-process figures checked at every step; then faults."""

import contextlib
import sys
import time
import uuid

import httpx
import psutil
import pytest

from hostagent.errors import (
    CannotParkError,
    EngineCallError,
    EngineExitedError,
    MemoryNotReleasedError,
    StartTimeoutError,
)
from hostagent.probe import SimulatedProbe
from hostagent.process import CappedLog, tail
from hostagent.runtime import EngineRuntime, InstanceRequest
from hostagent.simgpu import SimSpec
from tests.engine_http import engine_http

GIB = 1024**3
MIB = 1024**2
SIM = f"{sys.executable} -m hostagent.sim"

MEMORY = {
    "CAPYCTL_SIM_GPU_BYTES": "16GiB",
    "CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB",
    "CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB",
}


@pytest.fixture
def runtime(tmp_path):
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB, 24 * GIB]), tmp_path / "sim")
    return EngineRuntime(probe, tmp_path / "logs", release_timeout=2.0)


@pytest.fixture
def launched(runtime):
    instances = []

    def launch(kind, *, env=None, ram_park=True, gpus=(0,), command=None, options=None):
        request = InstanceRequest(
            instance_id=f"{kind}-{uuid.uuid4().hex[:6]}",
            kind=kind,
            command=command or f"{SIM} {kind}",
            source=f"/models/{kind}",
            served_name=f"{kind}-model",
            gpu_indices=list(gpus),
            env={**MEMORY, **(env or {})},
            ram_park=ram_park,
            options=options or {},
        )
        instance = runtime.launch(request)
        instances.append(instance)
        return instance

    yield launch
    for instance in instances:
        runtime.stop(instance, grace_seconds=2)


def chat(instance, stream=False):
    return engine_http(instance).post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {instance.api_key}"},
        json={
            "model": instance.request.served_name,
            "messages": [{"role": "user", "content": "hello there"}],
            "stream": stream,
        },
        timeout=10,
    )


def listening_addresses(pid):
    return {
        conn.laddr.ip
        for conn in psutil.Process(pid).net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_start_request_park_ram_wake_stop(runtime, launched, kind):
    instance = launched(kind)
    runtime.wait_ready(instance, timeout=30)
    # vLLM's --uds: a socket and no TCP port; SGLang 0.5.23 has none: loopback.
    assert listening_addresses(instance.pid) == (set() if kind == "vllm" else {"127.0.0.1"})
    assert (instance.socket_path is not None) == (kind == "vllm")
    assert chat(instance).json()["choices"][0]["message"]["content"].startswith("tok0")
    ready = runtime.usage(instance)
    assert ready.gpu == {0: 16 * GIB}

    residual = runtime.park(instance, "ram")
    assert residual.gpu == {0: 512 * MIB}
    assert residual.host_bytes >= 8 * GIB  # the weights copy sits in host RAM
    assert chat(instance).status_code == 503

    runtime.wake(instance, "ram", timeout=30)
    assert runtime.usage(instance).gpu == {0: 16 * GIB}
    assert runtime.usage(instance).host_bytes < 8 * GIB
    assert chat(instance).status_code == 200

    pid = instance.pid
    assert runtime.stop(instance) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert runtime.probe.process_usage(pid).gpu == {}
    assert runtime.probe.devices()[0].used_bytes == 0


@pytest.mark.parametrize(("kind", "ram_park"), [("vllm", True), ("sglang", False)])
def test_park_deep_drops_weights_and_wake_reloads_them(runtime, launched, kind, ram_park):
    instance = launched(kind, ram_park=ram_park)
    runtime.wait_ready(instance, timeout=30)
    residual = runtime.park(instance, "deep")
    assert residual.gpu == {0: 512 * MIB}
    assert residual.host_bytes < 8 * GIB  # nothing kept in RAM
    runtime.wake(instance, "deep", timeout=30)
    assert runtime.usage(instance).gpu == {0: 16 * GIB}
    # The simulated engine refuses to generate with weights that were never reloaded, so an
    # answer proves the kind ran the whole deep wake sequence.
    assert chat(instance).status_code == 200
    assert runtime.park(instance, "ram" if ram_park else "deep").gpu == {0: 512 * MIB}


@pytest.mark.parametrize(("kind", "ram_park"), [("vllm", True), ("sglang", False)])
def test_a_deep_park_and_its_wake_take_their_own_times(runtime, launched, kind, ram_park):
    times = {
        "CAPYCTL_SIM_SLEEP_SECONDS": "0.05",
        "CAPYCTL_SIM_WAKE_SECONDS": "0.3",
        "CAPYCTL_SIM_DEEP_SLEEP_SECONDS": "0.4",
        "CAPYCTL_SIM_DEEP_WAKE_SECONDS": "0.6",
    }
    instance = launched(kind, ram_park=ram_park, env=times)
    runtime.wait_ready(instance, timeout=30)

    def took(step, *args):
        started = time.monotonic()
        step(instance, *args)
        return time.monotonic() - started

    assert 0.4 <= took(runtime.park, "deep") < 0.7
    # The whole deep wake is its reload's 0.6 s: its wake calls take no wake time of their own.
    assert 0.6 <= took(runtime.wake, "deep", 30) < 0.9
    assert chat(instance).status_code == 200
    if ram_park:
        assert took(runtime.park, "ram") < 0.3
        assert 0.3 <= took(runtime.wake, "ram", 30) < 0.6


def test_an_sglang_launch_without_cpu_backup_cannot_park_ram(runtime, launched):
    instance = launched("sglang", ram_park=False)
    runtime.wait_ready(instance, timeout=30)
    with pytest.raises(CannotParkError, match="can park only 'deep'"):
        runtime.park(instance, "ram")
    assert runtime.usage(instance).gpu == {0: 16 * GIB}


@pytest.mark.parametrize("kind", ["llamacpp", "tensorfold"])
def test_kinds_that_cannot_park_say_so(runtime, launched, kind):
    instance = launched(kind, env={"CAPYCTL_SIM_VERSION": "0.5.3"})  # a TensorFold without sleep
    runtime.wait_ready(instance, timeout=30)
    # llama-server's --host PATH.sock: a socket; TensorFold has none: loopback.
    expected = set() if kind == "llamacpp" else {"127.0.0.1"}
    assert listening_addresses(instance.pid) == expected
    streamed = chat(instance, stream=True)
    assert streamed.status_code == 200
    assert streamed.text.rstrip().endswith("data: [DONE]")
    for mode in ("ram", "deep"):
        with pytest.raises(CannotParkError, match=f"{kind} cannot park"):
            runtime.park(instance, mode)
    assert runtime.usage(instance).gpu == {0: 16 * GIB}
    runtime.stop(instance)
    assert runtime.probe.devices()[0].used_bytes == 0


def test_llamacpp_health_is_503_while_loading(runtime, launched):
    instance = launched("llamacpp", env={"CAPYCTL_SIM_LOAD_SECONDS": "1.5"})
    seen = set()
    for _ in range(200):
        with contextlib.suppress(httpx.TransportError):
            seen.add(engine_http(instance).get("/health", timeout=1).status_code)
        if 503 in seen:
            break
    assert 503 in seen
    runtime.wait_ready(instance, timeout=30)
    assert engine_http(instance).get("/health").json() == {"status": "ok"}


def test_multi_gpu_launch_allocates_on_each_visible_gpu(runtime, launched):
    instance = launched("vllm", gpus=(0, 1))
    runtime.wait_ready(instance, timeout=30)
    assert runtime.usage(instance).gpu == {0: 16 * GIB, 1: 16 * GIB}
    residual = runtime.park(instance, "ram")
    assert residual.gpu == {0: 512 * MIB, 1: 512 * MIB}
    assert residual.host_bytes >= 16 * GIB


def test_the_api_key_guards_v1(runtime, launched):
    instance = launched("vllm")
    runtime.wait_ready(instance, timeout=30)
    url = "/v1/chat/completions"
    body = {"model": "vllm-model", "messages": []}
    client = engine_http(instance)
    assert client.post(url, json=body).status_code == 401
    assert client.post(url, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401


# --- faults ------------------------------------------------------------------------------


def test_a_park_that_keeps_its_memory_is_not_released(runtime, launched):
    instance = launched("vllm", env={"CAPYCTL_SIM_KEEP_MEMORY": "1"})
    runtime.wait_ready(instance, timeout=30)
    with pytest.raises(MemoryNotReleasedError, match="still sees its memory") as info:
        runtime.park(instance, "ram")
    assert info.value.still_held == {0: 16 * GIB}


def test_a_hung_wake_gives_up_at_its_timeout(runtime, launched):
    instance = launched("vllm", env={"CAPYCTL_SIM_HANG_ON_WAKE": "1"})
    runtime.wait_ready(instance, timeout=30)
    runtime.park(instance, "ram")
    with pytest.raises(EngineCallError, match="wake_up failed: ReadTimeout"):
        runtime.wake(instance, "ram", timeout=1)
    assert instance.process.alive()  # memory still counted: the process is still there


def test_a_crash_while_ready_is_detected(runtime, launched):
    instance = launched("vllm", env={"CAPYCTL_SIM_CRASH_AFTER": "1"})
    runtime.wait_ready(instance, timeout=30)
    with pytest.raises(httpx.HTTPError):
        chat(instance)  # the warm-up was request 1; this one kills it
    instance.process.wait(timeout=5)
    assert instance.process.exit_code() == 3
    with pytest.raises(EngineExitedError, match="exited with status 3"):
        runtime.park(instance, "ram")


def test_death_mid_stream_ends_the_stream(runtime, launched):
    instance = launched("llamacpp", env={"CAPYCTL_SIM_DIE_MID_STREAM": "1"})
    runtime.wait_ready(instance, timeout=30)
    with pytest.raises(httpx.HTTPError):
        chat(instance, stream=True)
    instance.process.wait(timeout=5)
    assert instance.process.exit_code() == 4


def test_a_slow_start_times_out_with_the_last_log_lines(runtime, launched):
    instance = launched("vllm", env={"CAPYCTL_SIM_LOAD_SECONDS": "30"})
    with pytest.raises(StartTimeoutError, match="not ready after 1s"):
        runtime.wait_ready(instance, timeout=1)


def test_an_engine_that_exits_fails_fast_with_its_logs(runtime, launched):
    command = f"{sys.executable} -c \"import sys; print('model file not found'); sys.exit(7)\""
    instance = launched("llamacpp", command=command)
    with pytest.raises(EngineExitedError, match="status 7") as info:
        runtime.wait_ready(instance, timeout=30)
    assert info.value.exit_code == 7
    assert "model file not found" in info.value.log_tail


def test_a_missing_program_is_a_clear_error(runtime, launched):
    with pytest.raises(EngineExitedError, match="could not start /nonexistent/vllm"):
        launched("vllm", command="/nonexistent/vllm")


def test_an_engine_ignoring_sigterm_is_killed_with_its_children(runtime, launched, tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal,time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print('child', child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    instance = launched("custom", command=f"{sys.executable} {script} {{host}} {{port}}")
    deadline = time.monotonic() + 10
    while "child" not in instance.process.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(instance.process.log_tail().split("child ")[1].split()[0])
    assert runtime.stop(instance, grace_seconds=0.5) == -9
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == "zombie"


def test_logs_are_capped(tmp_path):
    log = CappedLog(tmp_path / "engine.log", max_bytes=1000)
    for i in range(100):
        log.write(f"line {i:03d} {'x' * 40}\n".encode())
    assert (tmp_path / "engine.log").stat().st_size <= 1000
    assert (tmp_path / "engine.log.1").stat().st_size <= 1000
    assert tail(tmp_path / "engine.log", 2).splitlines()[-1].startswith("line 099")


def test_on_unified_memory_a_ram_park_frees_nothing_of_the_pool(tmp_path):
    probe = SimulatedProbe(SimSpec(unified=True, sizes=[64 * GIB]), tmp_path / "sim")
    runtime = EngineRuntime(probe, tmp_path / "logs", release_timeout=2.0)
    request = InstanceRequest(
        instance_id="unified", kind="vllm", command=f"{SIM} vllm", source="/m",
        served_name="u", gpu_indices=[0], env=MEMORY,
    )  # fmt: skip
    instance = runtime.launch(request)
    try:
        runtime.wait_ready(instance, timeout=30)
        assert probe.devices()[0].used_bytes == 16 * GIB
        runtime.park(instance, "ram")
        # The weights copy comes out of the same pool it was meant to free.
        assert probe.devices()[0].used_bytes == 512 * MIB + 8 * GIB
        runtime.wake(instance, "ram", timeout=30)
        runtime.park(instance, "deep")
        assert probe.devices()[0].used_bytes == 512 * MIB
    finally:
        runtime.stop(instance)
    assert probe.devices()[0].used_bytes == 0


def test_engines_launched_together_are_never_given_the_same_port():
    """An engine binds its port only once it runs, so the port is free again when the
    next launch asks: on the old code 2,000 asks gave the same port twice (the kernel
    picks at random from its ephemeral range), and two engines launched together could
    share one: the second's health check reached the first, and its warm-up got 401."""
    from hostagent.runtime import free_port

    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_the_state_file_survives_saves_from_many_threads_at_once(tmp_path):
    """A host saves its state file after each launch, park, wake and stop, from whichever
    thread ran it: saves at the same moment must not trip over each other's temporary
    file (a stop answered 500 when its save found the other's already renamed)."""
    import json
    import threading

    from hostagent.host import HostRuntime

    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB]), tmp_path / "sim")
    host = HostRuntime(probe, tmp_path / "logs", tmp_path / "instances.json")
    failures: list[BaseException] = []
    start = threading.Barrier(8)

    def save_often() -> None:
        start.wait()
        for _ in range(200):
            try:
                host._save()
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=save_often) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert json.loads((tmp_path / "instances.json").read_text()) == []
