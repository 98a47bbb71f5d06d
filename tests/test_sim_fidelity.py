"""The simulated engines hold to the real ones: their command lines (a flag the real
engine lacks is refused, its real flags are taken), their routes (the table in
docs/engines.md, held here to the simulators' routers) and TensorFold's own behaviours."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from hostagent.sim.options import parse_options, read_knobs
from hostagent.sim.server import SimEngine

DOCS = Path(__file__).resolve().parent.parent / "docs" / "engines.md"
KINDS = ("vllm", "sglang", "llamacpp", "tensorfold")
# Each simulator with the flags and environment every conditional route needs, and bare.
FULL = {
    "vllm": ["serve", "m", "--port", "1", "--enable-sleep-mode"],
    "sglang": ["--model-path", "m", "--port", "1", "--enable-memory-saver"],
    "llamacpp": ["-m", "m.gguf", "--port", "1"],
    "tensorfold": ["serve", "m", "--port", "1", "--enable-sleep-mode"],
}
BARE = {
    "vllm": ["serve", "m"],
    "sglang": ["--model-path", "m"],
    "llamacpp": ["-m", "m.gguf"],
    "tensorfold": ["serve", "m"],
}


def route_table() -> dict[str, dict[str, tuple[str, str]]]:
    """docs/engines.md's table: route -> kind -> (real, simulated)."""
    text = DOCS.read_text(encoding="utf-8").split("<!-- route-table -->", 1)[1]
    rows = text.strip().split("\n\n", 1)[0].splitlines()
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header == ["route", "vLLM", "SGLang", "llama.cpp", "TensorFold"]
    table: dict[str, dict[str, tuple[str, str]]] = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        pairs = {}
        for kind, cell in zip(KINDS, cells[1:], strict=True):
            # A note's mark (¹, ²) says how a served route behaves, not whether it is served.
            real, simulated = (part.strip().rstrip("¹²") for part in cell.split(" / "))
            pairs[kind] = (real, simulated)
        for route in re.findall(r"`([A-Z]+ [^`]+)`", cells[0]):
            table[route] = pairs
    return table


def served(kind: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    monkeypatch.setenv("TENSORFOLD_SLEEP_TOKEN", "t")
    engine = SimEngine(parse_options([kind, *argv]), read_knobs())
    routes = set()
    for route in engine.app().router.routes():
        resource = route.resource
        assert resource is not None
        if route.method != "HEAD":
            routes.add(f"{route.method} {resource.canonical}")
    return routes


def test_the_route_table_is_the_simulators_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    table = route_table()
    for kind in KINDS:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        full = served(kind, FULL[kind], monkeypatch)
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        bare = served(kind, BARE[kind], monkeypatch)
        assert full - set(table) == set(), f"{kind} serves routes the table lacks"
        for route, cells in table.items():
            real, simulated = cells[kind]
            where = f"{kind} {route}"
            if simulated == "no":
                assert route not in full, f"{where}: the table says the simulator lacks it"
            elif simulated == "yes":
                assert route in bare, f"{where}: the table says the simulator serves it"
            else:  # a condition: served with it, not without
                assert route in full, f"{where}: served with {simulated}"
                assert route not in bare, f"{where}: only with {simulated}"
            if simulated != "no":
                assert real != "no", f"{where}: the simulator serves what the engine lacks"


@pytest.mark.parametrize(
    ("kind", "argv", "refused"),
    [
        ("vllm", ["serve", "m", "--context", "4096"], "--context"),
        ("sglang", ["--model-path", "m", "--max-model-len", "8"], "--max-model-len"),
        ("tensorfold", ["serve", "m", "--max-model-len", "8"], "--max-model-len"),
        ("tensorfold", ["serve", "m", "--ctx-size", "8"], "--ctx-size"),
    ],
)
def test_an_argparse_engine_refuses_a_flag_it_lacks(
    kind: str, argv: list[str], refused: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_options([kind, *argv])
    assert exit_.value.code == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1
    assert f"unrecognized arguments: {refused}" in line


def test_llama_server_refuses_a_flag_it_lacks_in_its_own_words() -> None:
    answer = subprocess.run(
        [sys.executable, "-m", "hostagent.sim", "llamacpp", "-m", "m.gguf", "--max-model-len", "8"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (answer.returncode, answer.stderr) == (1, "error: invalid argument: --max-model-len\n")
    with pytest.raises(SystemExit, match='"-c": expected value'):
        parse_options(["llamacpp", "-m", "m.gguf", "-c"])
    with pytest.raises(SystemExit, match="invalid argument: --ctx"):  # no prefixes
        parse_options(["llamacpp", "-m", "m.gguf", "--ctx", "8"])


@pytest.mark.parametrize(
    ("kind", "argv"),
    [
        ("vllm", ["serve", "m", "--max-model-len", "4096", "-tp", "2", "--enforce-eager",
                  "--max_num_seqs", "8", "-O3", "--compilation-config.mode", "3",
                  "--no-enable-prefix-caching", "--trust-remote-code", "--dtype=half",
                  "--served-model-name", "a", "b", "--max-model", "8"]),
        ("sglang", ["--model-path", "m", "--tp-size", "2", "--context-length", "8",
                    "--trust-remote-code", "--mem-frac", "0.5", "--disable-radix-cache"]),
        ("llamacpp", ["-m", "m.gguf", "-c", "2048", "-t", "1", "-ngl", "99", "--jinja",
                      "--n_gpu_layers", "9", "-fa", "on", "--fit-target", "2048"]),
        ("tensorfold", ["serve", "m", "--context", "4096", "--no-update-check", "--tp", "1",
                        "--no-thinking", "--kv-dtype", "int8", "--alias", "x", "--cont", "8"]),
    ],
)  # fmt: skip
def test_each_engine_takes_its_real_flags(kind: str, argv: list[str]) -> None:
    options = parse_options([kind, *argv])
    assert options.source in ("m", "m.gguf")


def test_vllm_reads_the_flags_it_models_in_any_spelling() -> None:
    options = parse_options(
        ["vllm", "serve", "m", "--served_model_name", "a", "b", "--gpu-memory-util", "0.5",
         "--enable_sleep_mode", "--api-key", "k1"]
    )  # fmt: skip
    assert (options.served_name, options.memory_fraction) == ("a", 0.5)
    assert options.sleep_mode
    assert options.api_keys == {"k1"}
    assert parse_options(["vllm", "serve", "--model", "m2"]).source == "m2"
    assert not parse_options(["vllm", "serve", "m", "--disable-sleep-mode"]).sleep_mode


# -- TensorFold's behaviours ----------------------------------------------------------------


@pytest.fixture
async def tensorfold() -> Any:
    engine = SimEngine(parse_options(["tensorfold", "serve", "m", "--name", "tf"]), read_knobs())
    engine.ready.set()
    client = TestClient(TestServer(engine.app()))
    await client.start_server()
    yield client
    await client.close()


async def test_tensorfold_serves_an_unknown_model_under_its_name(
    tensorfold: TestClient[Any, Any],
) -> None:
    answer = await tensorfold.post(
        "/v1/chat/completions", json={"model": "other", "messages": [{"content": "hi"}]}
    )
    assert answer.status == 200
    assert (await answer.json())["model"] == "tf"


async def test_tensorfold_sends_usage_on_every_streams_last_chunk(
    tensorfold: TestClient[Any, Any],
) -> None:
    answer = await tensorfold.post(
        "/v1/chat/completions", json={"messages": [{"content": "hi"}], "stream": True}
    )
    text = await answer.text()
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line[6:7] == "{"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert all("usage" not in chunk for chunk in chunks[:-1])


async def test_tensorfold_routes_it_has_and_has_not(tensorfold: TestClient[Any, Any]) -> None:
    for path in ("/v1/embeddings", "/v1/audio/transcriptions", "/v1/audio/speech"):
        assert (await tensorfold.post(path, json={"input": "x"})).status == 404
    made = await (await tensorfold.post("/v1/responses", json={"input": "hi"})).json()
    assert (await tensorfold.post(f"/v1/responses/{made['id']}/cancel")).status in (404, 405)
    deleted = await tensorfold.delete(f"/v1/responses/{made['id']}")
    assert (await deleted.json())["deleted"] is True
    assert (await tensorfold.get(f"/v1/responses/{made['id']}")).status == 404
    message = await (
        await tensorfold.post("/v1/messages", json={"max_tokens": 3, "messages": []})
    ).json()
    assert (message["type"], message["content"][0]["text"]) == ("message", "tok0 tok1 tok2")
    tokens = await (await tensorfold.post("/tokenize", json={"prompt": "a bb"})).json()
    assert tokens["count"] == 2
    assert "tensorfold_requests_total" in await (await tensorfold.get("/metrics")).text()


def test_the_others_refuse_an_unknown_model() -> None:
    async def ask() -> int:
        engine = SimEngine(parse_options(["vllm", "serve", "m"]), read_knobs())
        engine.ready.set()
        async with TestClient(TestServer(engine.app())) as client:
            answer = await client.post("/v1/completions", json={"model": "other"})
            return answer.status

    import asyncio

    assert asyncio.run(ask()) == 404


def test_sglang_without_the_memory_saver_answers_a_release_and_frees_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As SGLang: the release routes are always there, and without --enable-memory-saver
    its memory saver is a no-op (a 200 that gives nothing back, which only the GPU probe
    finds out); with it, the release gives the KV cache and weights back."""
    monkeypatch.setenv("CAPYCTL_SIM_GPUS", "24GiB")
    monkeypatch.setenv("CAPYCTL_SIM_GPU_BYTES", "8GiB")
    monkeypatch.setenv("CAPYCTL_SIM_STATE_DIR", str(tmp_path))

    async def release(flags: list[str]) -> tuple[int, int, int]:
        engine = SimEngine(parse_options(["sglang", "--model-path", "m", *flags]), read_knobs())
        engine.memory.load()
        engine.ready.set()
        before = sum(engine.memory.gpu_bytes().values())
        async with TestClient(TestServer(engine.app())) as client:
            answer = await client.post("/release_memory_occupation", json={})
            status = answer.status
        return status, before, sum(engine.memory.gpu_bytes().values())

    import asyncio

    status, before, after = asyncio.run(release([]))
    assert (status, after) == (200, before)
    status, before, after = asyncio.run(release(["--enable-memory-saver"]))
    assert status == 200
    assert after < before / 2


# -- the Responses API's stream, and a chat request without its messages ---------------------


@pytest.fixture
async def engine_url(request: pytest.FixtureRequest) -> Any:
    """A simulated engine of the parametrized kind on a port of its own: its kind and
    its ``/v1`` URL."""
    kind = request.param
    engine = SimEngine(parse_options([kind, *BARE[kind]]), read_knobs())
    engine.ready.set()
    server = TestServer(engine.app())
    await server.start_server()
    yield kind, str(server.make_url("/v1"))
    await server.close()


async def read_helper_stream(client: openai.AsyncOpenAI, model: str) -> list[str]:
    """The event types the SDK's ``responses.stream()`` helper yields."""
    async with client.responses.stream(model=model, input="hi") as stream:
        return [event.type async for event in stream]


def served_model(kind: str) -> str:
    return "m.gguf" if kind == "llamacpp" else "m"


async def stream_events(base_url: str, model: str) -> list[dict[str, Any]]:
    """The raw events of a streamed Response, each ``data:`` as JSON."""
    async with httpx.AsyncClient() as client:
        answer = await client.post(
            f"{base_url}/responses", json={"model": model, "input": "hi", "stream": True}
        )
    return [json.loads(line[6:]) for line in answer.text.splitlines() if line[:6] == "data: "]


@pytest.mark.parametrize("engine_url", ["vllm", "sglang", "tensorfold"], indirect=True)
async def test_the_sdks_stream_helper_reads_each_engines_responses_stream(
    engine_url: tuple[str, str],
) -> None:
    kind, url = engine_url
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    async with client.responses.stream(model="m", input="hi") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    text = " ".join(f"tok{i}" for i in range(8))
    assert final.output_text == text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    if kind == "sglang":  # SGLang streams no deltas but for Harmony (gpt-oss) models
        assert kinds == ["response.created", "response.in_progress", "response.completed"]
    else:
        assert kinds.count("response.output_text.delta") == 8
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]


@pytest.mark.parametrize("engine_url", ["vllm"], indirect=True)
async def test_vllm_numbers_its_events_and_names_its_message_afresh_when_done(
    engine_url: tuple[str, str],
) -> None:
    _kind, url = engine_url
    events = await stream_events(url, "m")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    added, part, first = events[2:5]
    item_id = added["item"]["id"]
    assert (added["output_index"], added["item"]["status"]) == (0, "in_progress")
    assert part["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    assert (first["item_id"], first["output_index"], first["content_index"]) == (item_id, 0, 0)
    done = events[-1]["response"]
    assert done["output"][0]["id"].startswith("msg_")
    assert done["output"][0]["id"] != item_id  # vLLM builds the final Response again
    assert events[-2]["item"]["id"] == item_id


@pytest.mark.parametrize("engine_url", ["llamacpp"], indirect=True)
async def test_llama_servers_responses_stream_places_nothing_so_the_sdks_helper_fails(
    engine_url: tuple[str, str],
) -> None:
    _kind, url = engine_url
    events = await stream_events(url, "m.gguf")
    assert [event["type"] for event in events][:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert not any("output_index" in e or "sequence_number" in e for e in events)
    assert events[0]["response"] == {
        "id": events[-1]["response"]["id"], "object": "response", "status": "in_progress"
    }  # fmt: skip
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(TypeError, match="list indices must be integers or slices, not NoneType"):
        await read_helper_stream(client, "m.gguf")


@pytest.mark.parametrize("engine_url", ["tensorfold"], indirect=True)
async def test_tensorfold_ends_a_cut_off_response_incomplete(engine_url: tuple[str, str]) -> None:
    _kind, url = engine_url
    async with httpx.AsyncClient() as client:
        asked = {"model": "m", "input": "hi", "max_output_tokens": 2}
        whole = (await client.post(f"{url}/responses", json=asked)).json()
        answer = await client.post(f"{url}/responses", json={**asked, "stream": True})
    assert (whole["status"], whole["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"}
    )  # fmt: skip
    last = json.loads(answer.text.rstrip().splitlines()[-1][6:])
    assert (last["type"], last["response"]["status"]) == ("response.incomplete", "incomplete")


@pytest.mark.parametrize(
    ("engine_url", "refusal"),
    [
        ("vllm", {"error": {"type": "Bad Request", "param": None, "code": 400}}),
        ("sglang", {"object": "error", "type": "Bad Request", "param": None, "code": 400}),
        ("llamacpp", {"error": {"code": 400, "message": "'messages' is required",
                                "type": "invalid_request_error"}}),
        ("tensorfold", {"error": {"message": "messages must be a non-empty list",
                                  "type": "invalid_request_error", "param": "messages"}}),
    ],
    indirect=["engine_url"],
)  # fmt: skip
async def test_a_chat_without_messages_is_refused_as_each_engine_refuses_it(
    engine_url: tuple[str, str], refusal: dict[str, Any]
) -> None:
    kind, url = engine_url
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{url}/chat/completions", json={"model": served_model(kind)})
    assert answer.status_code == 400
    body = answer.json()
    message = (body.get("error") or body)["message"]
    if kind in ("vllm", "sglang"):  # pydantic's words, joined by FastAPI
        assert "'loc': ('body', 'messages'), 'msg': 'Field required'" in message
        (body.get("error") or body).pop("message")
    assert body == refusal


# -- LoRA adapters (hostagent/sim/adapters.py) ------------------------------------------------


def adapter_dir(root: Path, name: str, rank: int = 8) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank}), encoding="utf-8")
    return str(folder)


def run_engine(argv: list[str], steps: Any) -> Any:
    """Run ``steps(client)`` against an in-process simulated engine, loaded and ready."""

    async def main() -> Any:
        engine = SimEngine(parse_options(argv), read_knobs())
        engine.ready.set()
        async with TestClient(TestServer(engine.app())) as client:
            return await steps(client)

    import asyncio

    return asyncio.run(main())


def test_vllm_loads_lists_serves_and_unloads_adapters_as_vllm_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    monkeypatch.setenv("CAPYCTL_SIM_LORA_LOAD_SECONDS", "0")
    sql = adapter_dir(tmp_path, "sql")
    big = adapter_dir(tmp_path, "big", rank=64)

    async def steps(client: TestClient[Any, Any]) -> None:
        async def load(name: str, path: str) -> tuple[int, str]:
            answer = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
            )
            return answer.status, await answer.text()

        assert await load("sql", sql) == (200, "Success: LoRA adapter 'sql' added successfully.")
        status, text = await load("sql", sql)
        assert status == 400
        assert json.loads(text)["error"]["message"].startswith(
            "The lora adapter 'sql' has already been loaded."
        )
        status, text = await load("gone", str(tmp_path / "nowhere"))
        assert status == 404
        error = json.loads(text)["error"]
        assert (error["type"], error["message"]) == (
            "NotFoundError",
            f"Loading lora gone failed: No adapter found for {tmp_path / 'nowhere'}",
        )
        status, text = await load("big", big)  # rank 64 > --max-lora-rank 16
        assert status == 500
        assert "LoRA rank 64 is greater than max_lora_rank 16." in text

        cards = (await (await client.get("/v1/models")).json())["data"]
        assert [(c["id"], c.get("root"), c.get("parent")) for c in cards] == [
            ("m", None, None),
            ("sql", sql, "m"),
        ]
        answer = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
        assert (answer.status, (await answer.json())["model"]) == (200, "sql")
        answer = await client.post("/v1/completions", json={"model": "poet", "prompt": "hi"})
        assert answer.status == 404
        assert (await answer.json())["error"]["message"] == "The model `poet` does not exist."

        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert await unloaded.text() == "Success: LoRA adapter 'sql' removed successfully."
        again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert again.status == 404
        assert (await again.json())["error"]["message"] == "The lora adapter 'sql' cannot be found."
        answer = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
        assert answer.status == 404

    run_engine(["vllm", "serve", "m", "--enable-lora"], steps)


def test_vllm_without_runtime_updating_has_no_adapter_routes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)

    async def steps(client: TestClient[Any, Any]) -> int:
        answer = await client.post("/v1/load_lora_adapter", json={"lora_name": "a"})
        return answer.status

    assert run_engine(["vllm", "serve", "m", "--enable-lora"], steps) == 404


def test_sglang_loads_serves_and_refuses_adapters_as_sglang_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CAPYCTL_SIM_LORA_LOAD_SECONDS", "0")
    sql = adapter_dir(tmp_path, "sql")

    async def steps(client: TestClient[Any, Any]) -> None:
        async def call(route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            answer = await client.post(route, json=body)
            return answer.status, await answer.json()

        status, answer = await call("/load_lora_adapter", {"lora_name": "sql", "lora_path": sql})
        assert (status, answer) == (
            200,
            {"success": True, "error_message": "", "loaded_adapters": {"sql": sql}},
        )
        status, answer = await call("/load_lora_adapter", {"lora_name": "sql", "lora_path": sql})
        assert (status, answer["success"]) == (400, False)
        assert answer["error_message"] == (
            "LoRA with name sql already exists. Loaded LoRAs: odict_keys(['sql'])"
        )
        status, answer = await call("/unload_lora_adapter", {"lora_name": "poet"})
        assert (status, answer["success"]) == (400, False)
        assert answer["error_message"].startswith("LoRA with name poet does not exist.")
        status, answer = await call(
            "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")}
        )
        assert (status, answer["success"]) == (400, False)

        chat = {"model": "m", "messages": [{"content": "hi"}]}
        status, answer = await call("/v1/chat/completions", {**chat, "lora_path": "sql"})
        assert (status, answer["model"]) == (200, "m")
        status, answer = await call("/v1/chat/completions", {**chat, "model": "m:sql"})
        assert (status, answer["model"]) == (200, "m:sql")
        status, answer = await call("/v1/chat/completions", {**chat, "lora_path": "poet"})
        assert (status, answer["object"], answer["code"]) == (400, "error", 400)
        assert answer["message"].startswith(
            "The following requested LoRA adapters are not loaded: poet\n"
        )
        cards = (await (await client.get("/v1/models")).json())["data"]
        assert [c["id"] for c in cards if c.get("parent") == "m"] == ["sql"]

    argv = ["sglang", "--model-path", "m", "--served-model-name", "m", "--enable-lora",
            "--max-lora-rank", "16", "--lora-target-modules", "all"]  # fmt: skip
    run_engine(argv, steps)


def test_sglang_without_lora_says_so_and_will_not_start_lora_without_a_shape() -> None:
    async def steps(client: TestClient[Any, Any]) -> dict[str, Any]:
        answer = await client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"})
        assert answer.status == 400
        return dict(await answer.json())

    answer = run_engine(["sglang", "--model-path", "m"], steps)
    assert (
        answer["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    )
    with pytest.raises(SystemExit, match="both --max-lora-rank and --lora-target-modules"):
        parse_options(["sglang", "--model-path", "m", "--enable-lora"])


def test_llama_server_applies_its_launch_adapters_per_request(tmp_path: Path) -> None:
    files = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for file in files:
        file.write_bytes(b"lora")

    async def steps(client: TestClient[Any, Any]) -> None:
        listed = await (await client.get("/lora-adapters")).json()
        assert listed == [
            {"id": 0, "path": str(files[0]), "scale": 0.0},
            {"id": 1, "path": str(files[1]), "scale": 0.0},
        ]
        chat = {"model": "m", "messages": [{"content": "hi"}]}
        ok = await client.post(
            "/v1/chat/completions", json={**chat, "lora": [{"id": 1, "scale": 1}]}
        )
        assert ok.status == 200
        bad = await client.post(
            "/v1/chat/completions", json={**chat, "lora": [{"id": 2, "scale": 1}]}
        )
        assert bad.status == 400
        assert (await bad.json())["error"]["message"] == "invalid adapter id"

    argv = ["llamacpp", "-m", "m.gguf", "--alias", "m", "--lora", str(files[0]),
            "--lora", str(files[1]), "--lora-init-without-apply"]  # fmt: skip
    run_engine(argv, steps)


def test_adapter_slots_reserve_gpu_memory_from_the_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's slots come out of its share (its KV cache shrinks) and move with its weights
    on a park; llama-server's --lora files come on top of what it takes."""
    monkeypatch.setenv("CAPYCTL_SIM_GPUS", "24GiB")
    monkeypatch.setenv("CAPYCTL_SIM_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("CAPYCTL_SIM_LORA_SLOT_BYTES", "100MiB")

    def weights(argv: list[str]) -> tuple[int, int]:
        engine = SimEngine(parse_options(argv), read_knobs())
        engine.memory.load()
        held = sum(engine.memory.gpu_bytes().values())
        return held, sum(engine.memory.weights.values())

    plain = weights(["vllm", "serve", "m"])
    slots = weights(["vllm", "serve", "m", "--enable-lora", "--max-loras", "3"])
    assert slots == (plain[0], plain[1] + 300 * 1024**2)
    file = tmp_path / "a.gguf"
    file.write_bytes(b"x" * 4096)
    base = weights(["llamacpp", "-m", "m.gguf"])
    with_lora = weights(["llamacpp", "-m", "m.gguf", "--lora", str(file)])
    assert with_lora == (base[0] + 4096, base[1] + 4096)
