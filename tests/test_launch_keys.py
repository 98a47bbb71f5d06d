"""Launch keys never on a command line: every local user can read one (``ps``,
/proc/PID/cmdline). Each kind's engine gets its key the way that engine reads it (its
environment, or a 0600 file in its own run dir), refuses requests without it, and takes no
key from the host's environment."""

from __future__ import annotations

import stat
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from hostagent.errors import EngineExitedError
from hostagent.kinds.base import KEY_VARIABLES
from hostagent.probe import SimulatedProbe
from hostagent.process import inherited_env
from hostagent.runtime import EngineRuntime, Instance, InstanceRequest
from hostagent.simgpu import SimSpec
from tests.engine_http import engine_http
from tests.fakes import process_environ

GIB = 1024**3
SIM = f"{sys.executable} -m hostagent.sim"
HOST_KEY = "host-key-that-must-not-open-any-engine"
ENGINE_ENV_KEY = "engine-env-key-that-must-not-open-any-engine"

CUSTOM_WITH_FILE = (
    f"{SIM} llamacpp -m {{source}} --alias {{model}} --host {{host}} --port {{port}} "
    "--api-key-file {api_key_file}"
)
CUSTOM_WITH_ENV = (
    f"{SIM} vllm serve {{source}} --served-model-name {{model}} --host {{host}} --port {{port}}"
)
# kind, command, options, the variable the engine reads its key from (None: a file)
LAUNCHES = {
    "vllm": ("vllm", f"{SIM} vllm", {}, "VLLM_API_KEY"),
    "sglang": ("sglang", f"{SIM} sglang", {}, None),
    "llamacpp": ("llamacpp", f"{SIM} llamacpp", {}, "LLAMA_API_KEY"),
    "tensorfold": ("tensorfold", f"{SIM} tensorfold", {}, "TENSORFOLD_API_KEY"),
    "custom-file": ("custom", CUSTOM_WITH_FILE, {}, None),
    "custom-env": ("custom", CUSTOM_WITH_ENV, {"api_key_env": "VLLM_API_KEY"}, "VLLM_API_KEY"),
}


@pytest.fixture
def host_keys(tmp_path, monkeypatch):
    """A host whose environment carries a key for each engine that reads one from there
    (VLLM_ and LLAMA_ are prefixes engines inherit)."""
    key_file = tmp_path / "host-keys"
    key_file.write_text(HOST_KEY + "\n")
    for name in ("VLLM_API_KEY", "LLAMA_API_KEY", "TENSORFOLD_API_KEY"):
        monkeypatch.setenv(name, HOST_KEY)
    monkeypatch.setenv("LLAMA_ARG_API_KEY_FILE", str(key_file))


@pytest.fixture
def runtime(tmp_path):
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB]), tmp_path / "sim")
    return EngineRuntime(probe, tmp_path / "logs", release_timeout=2.0)


def command_lines(pid: int) -> list[bytes]:
    """The raw command line of ``pid`` and of every process under it."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [Path(f"/proc/{proc.pid}/cmdline").read_bytes() for proc in tree]


def chat(instance: Instance, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return (
        engine_http(instance)
        .post(
            "/v1/chat/completions",
            headers=headers,
            json={
                "model": instance.request.served_name,
                "messages": [{"role": "user", "content": "hello"}],
            },
            timeout=10,
        )
        .status_code
    )


@pytest.mark.parametrize("name", list(LAUNCHES))
@pytest.mark.usefixtures("host_keys")
def test_the_key_is_in_no_command_line_and_still_guards_the_engine(runtime, tmp_path, name):
    kind, command, options, variable = LAUNCHES[name]
    request = InstanceRequest(
        instance_id=f"{name}-{uuid.uuid4().hex[:6]}",
        kind=kind,
        command=command,
        source=f"/models/{name}",
        served_name=f"{name}-model",
        gpu_indices=[0],
        # An engine's own env may not add a key either.
        env={"CAPYCTL_SIM_GPU_BYTES": "4GiB", **dict.fromkeys(KEY_VARIABLES, ENGINE_ENV_KEY)},
        options=options,
    )
    instance = runtime.launch(request)
    run_dir = tmp_path / "run" / request.instance_id  # beside the logs
    try:
        runtime.wait_ready(instance, timeout=20)
        key = instance.api_key.encode()
        lines = command_lines(instance.pid)
        assert lines, "the engine's process tree"
        assert not [line for line in lines if key in line]

        assert chat(instance, None) == 401
        assert chat(instance, HOST_KEY) == 401
        assert chat(instance, ENGINE_ENV_KEY) == 401
        assert chat(instance, instance.api_key) == 200

        env = process_environ(instance.pid)
        assert HOST_KEY not in " ".join(env.values())
        assert ENGINE_ENV_KEY not in " ".join(env.values())
        assert "LLAMA_ARG_API_KEY_FILE" not in env
        if variable is not None:
            assert env[variable] == instance.api_key
        # The engine's own socket may be there beside a key file: no other file.
        files = [
            path
            for path in (run_dir.iterdir() if run_dir.exists() else [])
            if path != instance.socket_path
        ]
        if variable is None:
            (key_file,) = files
            assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            assert instance.api_key in key_file.read_text()
        else:
            assert files == []  # the key is in the engine's environment only
    finally:
        runtime.stop(instance, grace_seconds=2)
    assert not run_dir.exists()  # the key file goes with the engine


def test_no_key_variable_is_inherited_from_the_host(monkeypatch):
    for name in KEY_VARIABLES:
        monkeypatch.setenv(name, HOST_KEY)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the prefix itself still passes
    inherited = inherited_env()
    assert not KEY_VARIABLES & set(inherited)
    assert inherited["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert {
        "VLLM_API_KEY",
        "LLAMA_API_KEY",
        "LLAMA_ARG_API_KEY_FILE",
        "TENSORFOLD_API_KEY",
        "TENSORFOLD_SLEEP_TOKEN",
    } == KEY_VARIABLES


def test_an_engine_that_logs_its_key_does_not_show_it_in_its_failure(runtime):
    """Engines may log their own arguments (SGLang prints its server_args, the key from its
    config file among them): the log tail that reaches events and errors never holds the
    launch key."""
    printer = "import sys; print('api_key=' + open(sys.argv[1]).read().strip()); sys.exit(3)"
    request = InstanceRequest(
        instance_id=f"leaky-{uuid.uuid4().hex[:6]}",
        kind="custom",
        command=f'{sys.executable} -c "{printer}" {{api_key_file}} {{host}} {{port}}',
        source="/models/leaky",
        served_name="leaky-model",
    )
    instance = runtime.launch(request)
    with pytest.raises(EngineExitedError) as failure:
        runtime.wait_ready(instance, timeout=20)
    assert instance.api_key not in str(failure.value)
    assert "api_key=[launch key]" in failure.value.log_tail
    assert instance.api_key not in instance.process.log_tail()
