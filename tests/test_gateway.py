"""The /v1 gateway against a running standalone server with simulated GPUs and engines."""

import json
import signal
import sys

import httpx
import pytest

from tests.conftest import run_program, start_server, stop_server

pytestmark = pytest.mark.e2e

SIM = f"{sys.executable} -m hostagent.sim"


@pytest.fixture
def served(program_env):
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    program_env["CAPYCTL_MAX_BODY_BYTES"] = "64KiB"
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    for name, extra in (("a", ["--alias", "model-a"]), ("b", []), ("big", []), ("off", [])):
        gib = "30GiB" if name == "big" else "16GiB"
        added = run("deployment", "add", name, "--engine", "sim", "--source", f"/m/{name}",
                    "--gpu-memory", gib, *extra)  # fmt: skip
        assert added.code == 0, added.err
    key = run("key", "create", "--user", "admin").out.strip()
    only_a = run("key", "create", "--user", "admin", "--models", "a").out.strip()
    server = start_server(program_env)
    assert run("deployment", "stop", "off").code == 0
    try:
        yield server, key, only_a, run
    finally:
        stop_server(server, signal.SIGTERM)


def chat(server, key, model, **extra):
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra},
        timeout=60,
    )


def test_requests_start_wait_for_wakes_and_stream(served):
    server, key, _, run = served
    first = chat(server, key, "model-a")  # by alias; starts a on demand
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"].startswith("tok0")
    assert float(first.headers["x-capyctl-overhead-ms"]) >= 0
    assert "x-capyctl-waited-ms" in first.headers

    warm = chat(server, key, "a")
    assert "x-capyctl-waited-ms" not in warm.headers

    switched = chat(server, key, "b", stream=True, stream_options={"include_usage": True})
    assert switched.status_code == 200
    lines = [line for line in switched.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 8
    states = {
        d["name"]: d["observed_state"] for d in json.loads(run("deployment", "list", "--json").out)
    }
    assert states["a"] == "parked"
    assert states["b"] == "ready"

    models = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": key}).json()
    listed = {m["id"]: m["state"] for m in models["data"]}
    assert listed["b"] == "ready"
    assert listed["a"] == "parked"


def test_errors_are_openai_shaped(served):
    server, key, only_a, _ = served
    bad_key = chat(server, "capy_nope_nope", "a")
    assert bad_key.status_code == 401
    assert bad_key.json()["error"]["code"] == "invalid_api_key"
    assert chat(server, key, "ghost").json()["error"]["code"] == "model_not_found"
    limited = chat(server, only_a, "b")
    assert limited.status_code == 404
    assert limited.json()["error"]["message"] == chat(server, key, "ghost").json()["error"][
        "message"
    ].replace("ghost", "b")
    stopped = chat(server, key, "off")
    assert stopped.status_code == 503
    assert stopped.json()["error"]["code"] == "model_stopped"
    assert stopped.headers["x-should-retry"] == "false"
    too_big = chat(server, key, "big")
    assert too_big.status_code == 503
    assert too_big.json()["error"]["code"] == "no_capacity"
    assert "largest GPU pool" in too_big.json()["error"]["message"]
    not_json = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        content=b"{not json",
    )
    assert not_json.status_code == 400
    huge = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        content=b"x" * (65 * 1024),
    )
    assert huge.status_code == 413
