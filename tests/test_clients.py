"""The clients people point at ``/v1`` work through a real standalone server, against a
simulated vLLM (``sim-a``) and the real llama.cpp ``llama-server`` with a small GGUF model
(``smollm``): the ``openai`` SDK's ``responses.stream()`` helper, ``litellm.completion``
(plain and streamed) and ``langchain-openai``'s ``ChatOpenAI`` (invoke and stream).

llama-server's Responses stream places none of its events (no ``output_index``, no
``sequence_number``); the gateway passes it on as the engine sent it, so the SDK's helper
fails on it while the raw stream reads (docs/engines.md, "Routes, real and simulated")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import LiveServer, sim_engine
from tests.test_llama_server import llama_server_binary, smollm2_gguf

pytestmark = pytest.mark.e2e

SIM_TEXT = " ".join(f"tok{i}" for i in range(8))  # the simulator's answer: 8 tokens
ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(settings={"CAPYCTL_MIN_READY_SECONDS": "0"})
    try:
        live.start(
            sim_engine("sim", {}),
            ["deployment", "add", "sim-a", "--engine", "sim", "--source", "m-a"],
            ["engine", "add", "llama", "--kind", "llamacpp", "--command", llama_server_binary()],
            ["deployment", "add", "smollm", "--engine", "llama", "--source", smollm2_gguf(),
             "--gpus", "0", "--args", "-t 1 -c 2048"],
        )  # fmt: skip
        live.commands(["deployment", "start", "sim-a"], ["deployment", "start", "smollm"])
        states = live.settled(timeout=60).states
        assert states["sim-a"][0] == states["smollm"][0] == "ready", states
        yield live
    finally:
        live.close()


@pytest.fixture(scope="module")
def litellm() -> Iterator[Any]:
    """litellm, offline: its cost map from the package, nothing fetched on its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        patch.setenv("LITELLM_OFFLINE_MODE", "true")
        import litellm

        yield litellm


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


def test_the_openai_sdks_responses_stream_helper_reads_the_simulated_vllm(
    server: LiveServer,
) -> None:
    with sdk(server).responses.stream(model="sim-a", input="hi") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == SIM_TEXT


def test_llama_servers_responses_stream_passes_through_as_it_is_sent(server: LiveServer) -> None:
    """The raw stream reads, its events unplaced as llama-server sends them; the SDK's
    helper, which needs each event's ``output_index``, fails on it."""
    client = sdk(server)
    asked: dict[str, Any] = {"model": "smollm", "input": "Say hello.", "max_output_tokens": 8}
    events = list(client.responses.create(**asked, stream=True))
    assert [event.type for event in events][:3] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    assert all(getattr(e, "output_index", None) is None for e in deltas)
    assert all(getattr(e, "sequence_number", None) is None for e in events)
    completed = events[-1]
    assert completed.type == "response.completed"
    assert "".join(e.delta for e in deltas) == completed.response.output_text
    with (
        pytest.raises(TypeError, match="list indices must be integers or slices, not NoneType"),
        client.responses.stream(**asked) as stream,
    ):
        list(stream)


@pytest.mark.parametrize("model", ["sim-a", "smollm"])
def test_litellm_completion_plain_and_streamed(
    server: LiveServer, litellm: Any, model: str
) -> None:
    asked = {
        "model": f"openai/{model}",
        "api_base": f"{server.url}/v1",
        "api_key": server.key,
        "messages": ASK,
        "max_tokens": 8,
        "temperature": 0,
    }
    plain = litellm.completion(**asked)
    text = plain.choices[0].message.content
    assert text.strip()
    assert plain.usage.completion_tokens > 0
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in litellm.completion(**asked, stream=True)
        if chunk.choices
    )
    assert streamed == text
    if model == "sim-a":
        assert text == SIM_TEXT


@pytest.mark.parametrize("model", ["sim-a", "smollm"])
def test_langchain_chat_openai_invoke_and_stream(server: LiveServer, model: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=model,
        base_url=f"{server.url}/v1",
        api_key=server.key,  # type: ignore[arg-type]
        max_tokens=8,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
    )
    answer = chat.invoke("Say hello.")
    assert isinstance(answer.content, str)
    assert answer.content.strip()
    streamed = "".join(str(chunk.content) for chunk in chat.stream("Say hello."))
    assert streamed == answer.content
    if model == "sim-a":
        assert answer.content == SIM_TEXT


def test_a_chat_without_messages_is_refused_by_the_simulated_vllm_and_the_real_llama_server(
    server: LiveServer,
) -> None:
    def refusal(model: str) -> tuple[int, str]:
        answer = httpx.post(
            f"{server.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {server.key}"},
            json={"model": model},
            timeout=30,
        )
        return answer.status_code, answer.json()["error"]["message"]

    status, message = refusal("sim-a")  # vLLM's words: pydantic's, joined by FastAPI
    assert status == 400
    assert "'loc': ('body', 'messages'), 'msg': 'Field required'" in message
    assert refusal("smollm") == (400, "'messages' is required")
