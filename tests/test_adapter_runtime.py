"""Adapters loaded into a running engine through the host runtime, as the control plane
drives them: a simulated vLLM and SGLang process each, the agent's wire form of the
request and of the error, and the sources the host resolves itself."""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from hostagent import wire
from hostagent.errors import AdapterError
from hostagent.host import HostRuntime
from hostagent.probe import SimulatedProbe
from hostagent.runtime import InstanceRequest
from hostagent.simgpu import SimSpec
from tests.engine_http import engine_http

GIB = 1024**3
SIM = f"{sys.executable} -m hostagent.sim"


def adapter_dir(root: Path, name: str, rank: int = 8) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank}), encoding="utf-8")
    return folder


@pytest.fixture
def host(tmp_path: Path) -> Any:
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB]), tmp_path / "sim")
    runtime = HostRuntime(probe, tmp_path / "logs", tmp_path / "instances.json")
    yield runtime
    runtime.stop_all(grace_seconds=2)


def launch(host: HostRuntime, kind: str, **changes: Any) -> str:
    request = InstanceRequest(
        instance_id=f"{kind}-{uuid.uuid4().hex[:6]}",
        kind=kind,
        command=f"{SIM} {kind}",
        source=f"/models/{kind}",
        served_name="base",
        gpu_indices=[0],
        env={"CAPYCTL_SIM_GPU_BYTES": "8GiB", "CAPYCTL_SIM_LORA_LOAD_SECONDS": "0.2"},
        **changes,
    )
    host.launch(request)
    host.wait_ready(request.instance_id, timeout=30)
    return request.instance_id


def chat(host: HostRuntime, ident: str, **fields: Any) -> Any:
    instance = host.instance(ident)
    assert instance is not None
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], **fields}
    headers = {"Authorization": f"Bearer {instance.api_key}"}
    return engine_http(instance).post("/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [("vllm", {"model": "sql"}), ("sglang", {"lora_path": "sql"})],
)
def test_load_serve_and_unload_an_adapter(
    host: HostRuntime, tmp_path: Path, kind: str, fields: dict[str, Any]
) -> None:
    ident = launch(host, kind, adapter_slots=2, adapter_max_rank=16)
    source = str(adapter_dir(tmp_path, "sql"))
    assert host.loaded_adapters(ident) == []
    assert chat(host, ident, **fields).status_code in (400, 404)  # not loaded yet

    seconds = host.load_adapter(ident, "sql", source, timeout=30)
    assert 0.2 <= seconds < 10  # CAPYCTL_SIM_LORA_LOAD_SECONDS
    assert host.loaded_adapters(ident) == ["sql"]
    assert chat(host, ident, **fields).status_code == 200
    host.load_adapter(ident, "sql", source, timeout=30)  # already loaded: success

    big = str(adapter_dir(tmp_path, "big", rank=64))
    with pytest.raises(AdapterError, match=f"{kind} refused to load adapter big: .*rank"):
        host.load_adapter(ident, "big", big, timeout=30)

    host.unload_adapter(ident, "sql")
    host.unload_adapter(ident, "sql")  # not loaded: success
    assert host.loaded_adapters(ident) == []
    assert chat(host, ident, **fields).status_code in (400, 404)


def test_the_host_loads_only_sources_it_resolved_itself(host: HostRuntime, tmp_path: Path) -> None:
    ident = launch(host, "vllm", adapter_slots=1)
    with pytest.raises(AdapterError, match="hf://org/sql is not fetched on this host"):
        host.load_adapter(ident, "sql", "hf://org/sql", timeout=10)
    with pytest.raises(AdapterError, match="does not exist"):
        host.load_adapter(ident, "sql", str(tmp_path / "missing"), timeout=10)
    with pytest.raises(AdapterError, match="neither a local path"):
        host.load_adapter(ident, "sql", "org/sql", timeout=10)
    with pytest.raises(AdapterError, match="invalid adapter name"):
        host.load_adapter(ident, "../x", str(adapter_dir(tmp_path, "a")), timeout=10)
    assert host.loaded_adapters(ident) == []


def test_vllm_launched_without_slots_has_no_adapter_routes(
    host: HostRuntime, tmp_path: Path
) -> None:
    ident = launch(host, "vllm")
    with pytest.raises(AdapterError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        host.load_adapter(ident, "sql", str(adapter_dir(tmp_path, "sql")), timeout=10)


def test_a_request_with_adapters_and_an_adapter_error_travel_as_json() -> None:
    request = InstanceRequest(
        instance_id="i", kind="llamacpp", command="c", source="/m", served_name="m",
        adapter_slots=2, adapters=[("sql", "/a/sql.gguf")],
    )  # fmt: skip
    as_json = json.loads(json.dumps(asdict(request)))
    assert as_json["adapters"] == [["sql", "/a/sql.gguf"]]
    assert wire.request_from_json(as_json) == request
    with pytest.raises(ValueError, match="adapters must be"):
        wire.request_from_json({**as_json, "adapters": [["sql"]]})
    with pytest.raises(ValueError, match="adapter_slots must be"):
        wire.request_from_json({**as_json, "adapter_slots": -1})
    error = wire.error_from_json(wire.error_to_json(AdapterError("vllm refused: nope")))
    assert type(error) is AdapterError
    assert str(error) == "vllm refused: nope"


def agent_call(app: Any, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One request to the agent's ASGI app, in process: its status and JSON answer."""
    import asyncio

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(body or {}).encode()}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b""}
    asyncio.run(app(scope, receive, send))
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(answer)


def test_the_agent_serves_the_adapter_routes(host: HostRuntime, tmp_path: Path) -> None:
    from hostagent.agent import AgentApp

    app = AgentApp("gpu-box", host)
    ident = launch(host, "vllm", adapter_slots=1)
    base = f"/instances/{ident}/adapters"
    source = str(adapter_dir(tmp_path, "sql"))
    status, answer = agent_call(app, "POST", f"{base}/load", {"name": "sql", "source": source,
                                                               "timeout": 30})  # fmt: skip
    assert status == 200
    assert answer["seconds"] >= 0.2
    assert agent_call(app, "GET", base) == (200, {"loaded": ["sql"]})
    # A refusal crosses as the same error class (409, as every engine error).
    status, answer = agent_call(app, "POST", f"{base}/load", {"name": "x", "source": "hf://o/x",
                                                               "timeout": 5})  # fmt: skip
    assert status == 409
    assert type(wire.error_from_json(answer["error"])) is AdapterError
    assert agent_call(app, "POST", f"{base}/unload", {"name": "sql"}) == (200, {})
    assert agent_call(app, "GET", base) == (200, {"loaded": []})
