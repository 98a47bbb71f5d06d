"""The /v1 gateway against a running standalone server with simulated GPUs and engines."""

import asyncio
import json
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_program, run_programs, start_server, stop_server
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

SIM = f"{sys.executable} -m hostagent.sim"

METRICS_TOKEN = "scrape-token-0123456789"


def load_gate(program_env):
    """The file that ends the load of the ``slow`` engine (q's): it loads until it exists."""
    return Path(program_env["CAPYCTL_DATA_DIR"]).parent / "slow-load-gate"


@pytest.fixture
def served(program_env):
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    program_env["CAPYCTL_MAX_BODY_BYTES"] = "64KiB"
    program_env["CAPYCTL_METRICS_TOKEN"] = METRICS_TOKEN
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    slow = ["--env", f"CAPYCTL_SIM_LOAD_GATE={load_gate(program_env)}"]
    trickle = ["--env", "CAPYCTL_SIM_TOKENS_PER_SECOND=5",
               "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=100"]  # fmt: skip
    broken = f"{sys.executable} -c 'import sys; print(\"no such model file\"); sys.exit(3)'"
    setup: list[list[str]] = [
        ["engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm"],
        ["engine", "add", "slow", "--kind", "vllm", "--command", f"{SIM} vllm", *slow],
        ["deployment", "add", "q", "--engine", "slow", "--source", "m-q",
         "--gpu-memory", "4GiB", "--max-waiting", "5"],
        ["engine", "add", "sleepy", "--kind", "vllm", "--command", f"{SIM} vllm",
         "--env", "CAPYCTL_SIM_LOAD_SECONDS=5"],
        ["deployment", "add", "sleepy", "--engine", "sleepy", "--source", "m",
         "--gpu-memory", "1GiB", "--wake-timeout", "1"],
        ["engine", "add", "trickle", "--kind", "vllm", "--command", f"{SIM} vllm", *trickle],
        ["deployment", "add", "trickle", "--engine", "trickle", "--source", "m",
         "--gpu-memory", "1GiB"],
        ["engine", "add", "dies", "--kind", "vllm", "--command", f"{SIM} vllm",
         "--env", "CAPYCTL_SIM_DIE_MID_STREAM=1"],
        ["deployment", "add", "dies", "--engine", "dies", "--source", "m", "--gpu-memory", "1GiB"],
        ["engine", "add", "broken", "--kind", "llamacpp", "--command", broken],
        ["deployment", "add", "broken", "--engine", "broken", "--source", "m", "--gpus", "0"],
        ["deployment", "add", "a", "--engine", "sim", "--source", "m-a", "--gpu-memory", "16GiB",
         "--alias", "model-a", "--max-waiting", "1000"],
        *(["deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
           "--gpu-memory", "30GiB" if name == "big" else "16GiB"] for name in ("b", "big", "off")),
        ["key", "create", "--user", "admin"],
        ["key", "create", "--user", "admin", "--models", "a"],
    ]  # fmt: skip
    results = run_programs(program_env, *setup)
    for argv, result in zip(setup, results, strict=True):
        assert result.code == 0, (argv, result.err)
    key, only_a = results[-2].out.strip(), results[-1].out.strip()
    server = start_server(program_env)
    assert run("deployment", "stop", "off").code == 0
    try:
        yield server, key, only_a, run
    finally:
        stop_server(server, signal.SIGTERM)


def key_row(run, key):
    """``key``'s row in `capyctl key list --json` (its usage counts)."""
    rows = {k["id"]: k for k in json.loads(run("key", "list", "--json").out)}
    return rows[key.split("_")[1]]


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
    assert int(first.headers["x-capyctl-queued-ms"]) > 0  # it waited for the start

    warm = chat(server, key, "a")
    assert warm.headers["x-capyctl-queued-ms"] == "0"

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


def test_the_official_openai_client_works_through_it(served):
    import openai

    server, key, _, _ = served
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    assert {m.id for m in client.models.list().data} >= {"a", "b", "big", "off"}
    reply = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert reply.choices[0].message.content == "tok0 tok1 tok2"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3
    chunks = list(
        client.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("tok0 tok1")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    completion = client.completions.create(model="a", prompt="Once", max_tokens=2)
    assert completion.choices[0].text == "tok0 tok1"
    embedding = client.embeddings.create(model="a", input=["one", "two"])
    assert len(embedding.data) == 2
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ghost", messages=[])


def test_responses_audio_and_one_model_through_the_openai_client(served):
    import openai

    server, key, _, run = served
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    assert client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ghost")

    made = client.responses.create(model="model-a", input="Say three words", max_output_tokens=3)
    assert made.output_text == "tok0 tok1 tok2"
    assert made.usage is not None
    assert made.usage.output_tokens == 3
    # GET /v1/responses/{id} names no model: it reaches the engine that made the response.
    again = client.responses.retrieve(made.id)
    assert again.id == made.id
    assert again.output_text == "tok0 tok1 tok2"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(made.id)
    with pytest.raises(openai.NotFoundError, match="resp_unknown"):
        client.responses.retrieve("resp_unknown")

    events = list(client.responses.create(model="a", input="Stream it", stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    deltas = "".join(
        e.delta for e in events if isinstance(e, openai.types.responses.ResponseTextDeltaEvent)
    )
    assert deltas.startswith("tok0 tok1")
    created = events[0]
    assert isinstance(created, openai.types.responses.ResponseCreatedEvent)
    assert client.responses.retrieve(created.response.id).status == "completed"

    # Audio: a multipart upload in (the model named by an alias inside the form)...
    sound = bytes(range(256)) * 64
    heard = client.audio.transcriptions.create(model="model-a", file=("clip.wav", sound))
    assert heard.text.startswith(f"{len(sound)} bytes of audio")
    # ...and binary audio out, byte for byte.
    spoken = client.audio.speech.create(model="a", input="hello", voice="alloy")
    audio = spoken.read()
    assert audio[:4] == b"RIFF"
    assert audio[8:12] == b"WAVE"
    assert len(audio) == 44 + 1600

    # Usage is written off the request path, a batch at a time: wait until it is.
    # The Responses API counts input/output tokens: 3 from the first answer, 8 streamed.
    wait_until(lambda: key_row(run, key)["completion_tokens"] >= 11, "the usage to be written")


def test_a_client_that_goes_away_cancels_its_upstream_request(served, program_env):
    server, key, _, run = served
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "trickle", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=60,
    ) as streaming:
        assert streaming.status_code == 200
        first = next(streaming.iter_lines())
        assert first.startswith("data: ")
    # The client hung up 100 tokens early (20 s of generation at 5 tokens/s): the engine
    # must see its request cancelled, and the model must not count it as in flight.
    logs = Path(program_env["CAPYCTL_DATA_DIR"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = "".join(p.read_text() for p in logs.rglob("*.log"))
        if "cancelled by the client" in text:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the engine never saw the request cancelled")
    started = time.monotonic()
    parked = run("deployment", "park", "trickle")
    assert parked.code == 0, parked.err
    assert time.monotonic() - started < 10  # no draining of a request that is gone


def test_metrics_parse_and_show_a_switch(served):
    from prometheus_client.parser import text_string_to_metric_families

    server, key, _, _ = served
    assert chat(server, key, "a").status_code == 200
    assert chat(server, key, "b").status_code == 200  # a is parked to make room
    assert chat(server, key, "ghost").status_code == 404
    assert chat(server, "capy_nope_nope", "a").status_code == 401
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401  # no token
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    text = httpx.get(f"{server.base_url}/metrics", headers=scraper).text
    assert "capy_" not in text  # no key, not even a refused one, in any label
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["capyctl_requests_total", (("model", "a"), ("status", "200"))] == 1
    assert samples["capyctl_requests_total", (("model", "-"), ("status", "404"))] == 1
    assert samples["capyctl_requests_total", (("model", "-"), ("status", "401"))] == 1
    assert samples["capyctl_wait_seconds_count", (("model", "b"),)] == 1
    assert samples["capyctl_overhead_seconds_count", (("model", "b"),)] == 1
    assert samples["capyctl_switch_steps_total", (("step", "park"),)] == 1
    assert samples["capyctl_switch_step_seconds_total", (("step", "start"),)] > 0
    assert samples["capyctl_deployment_state", (("model", "a"), ("state", "parked"))] == 1
    assert samples["capyctl_deployment_state", (("model", "b"), ("state", "ready"))] == 1
    held = [v for (name, labels), v in samples.items()
            if name == "capyctl_ledger_bytes" and ("status", "held") in labels]  # fmt: skip
    assert sum(held) >= 16 * 1024**3


def test_keys_count_usage_and_limits_and_revocation_is_quick(served):
    server, key, _, run = served
    assert chat(server, key, "a", max_tokens=2).status_code == 200
    limited_key = run("key", "create", "--user", "admin", "--rpm", "2").out.strip()
    assert chat(server, limited_key, "a").status_code == 200
    assert chat(server, limited_key, "a").status_code == 200
    third = chat(server, limited_key, "a")
    assert third.status_code == 429
    assert third.json()["error"]["code"] == "rate_limited"
    assert int(third.headers["retry-after"]) >= 1

    # Usage is written after each response, off the request path: wait until it is.
    def written():
        row = key_row(run, key)
        return row if row["requests"] >= 1 else None

    used = wait_until(written, "the usage to be written")
    assert used["completion_tokens"] >= 2
    assert used["last_used_at"] is not None

    assert run("key", "revoke", key.split("_")[1]).code == 0
    # The time is the promise here: a revoked key stops working within a second. The
    # revocation was committed before the command returned, and the gateway trusts no key
    # read that began longer ago than a second, however loaded the machine.
    time.sleep(1.1)
    refused = chat(server, key, "a")
    assert refused.status_code == 401


def test_a_thousand_requests_for_a_parked_model_cause_one_wake(served, program_env):
    import asyncio

    server, key, _, run = served
    assert chat(server, key, "a").status_code == 200
    assert chat(server, key, "b").status_code == 200  # a is parked now

    async def burst(model: str, count: int) -> list[int]:
        limits = httpx.Limits(max_connections=1000)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:

            async def one() -> int:
                response = await client.post(
                    f"{server.base_url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                )
                return response.status_code

            return await asyncio.gather(*(one() for _ in range(count)))

    statuses = asyncio.run(burst("a", 1000))
    assert statuses.count(200) == 1000
    events = run("events", "--model", "a", "--limit", "200").out
    assert events.count("deployment.woke") == 1

    # q lets 5 wait: while its start is held (its engine loads until the gate file
    # exists), the other 15 are told at once that the queue is full; then the load ends
    # and the 5 are answered. However the 20 requests are spread out, all land in the hold.
    assert run("deployment", "stop", "b").code == 0

    async def queue_burst() -> tuple[int, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as client:
            sent = [
                asyncio.ensure_future(
                    client.post(
                        f"{server.base_url}/v1/chat/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": "q", "messages": [{"role": "user", "content": "hi"}]},
                    )
                )
                for _ in range(20)
            ]
            deadline = asyncio.get_running_loop().time() + 60
            while sum(s.done() for s in sent) < 15:
                if asyncio.get_running_loop().time() > deadline:
                    break  # the counts below say what went wrong
                await asyncio.sleep(0.05)
            waiting = sum(not s.done() for s in sent)
            load_gate(program_env).touch()
            return waiting, list(await asyncio.gather(*sent))

    waiting, answers = asyncio.run(queue_burst())
    assert waiting == 5  # held while the start was
    assert sorted(a.status_code for a in answers) == [200] * 5 + [429] * 15
    for refused in (a for a in answers if a.status_code == 429):
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1


def test_a_slow_start_times_out_and_a_broken_engine_fails(served):
    server, key, _, _ = served
    slow = chat(server, key, "sleepy")
    assert slow.status_code == 504
    assert slow.json()["error"]["code"] == "wake_timeout"
    broken = chat(server, key, "broken")
    assert broken.status_code == 502
    error = broken.json()["error"]
    assert error["code"] == "engine_failed"
    assert "no such model file" in error["message"]


def test_an_engine_that_dies_mid_stream_ends_it_with_an_error_event(served):
    server, key, _, _ = served
    answer = chat(server, key, "dies", stream=True)
    assert answer.status_code == 200  # the headers were already on their way
    lines = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["content"]
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "engine_failed"
    assert "data: [DONE]" not in lines


def test_the_real_llama_server_answers_through_v1_and_makes_room(program_env):
    """llama.cpp cannot park: it is stopped to make room, and started again on demand."""
    from tests.test_llama_server import llama_server_binary, smollm2_gguf

    program_env["CAPYCTL_SIM_GPUS"] = "2GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    program_env["CAPYCTL_GPU_RESERVE"] = "0"
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    assert run("engine", "add", "llama", "--kind", "llamacpp",
               "--command", llama_server_binary()).code == 0  # fmt: skip
    assert run("deployment", "add", "smollm", "--engine", "llama", "--source", smollm2_gguf(),
               "--gpu-memory", "1536MiB", "--args", "-t 1 -c 2048").code == 0  # fmt: skip
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    assert run("deployment", "add", "other", "--engine", "sim", "--source", "m",
               "--gpu-memory", "1536MiB").code == 0  # fmt: skip
    key = run("key", "create", "--user", "admin").out.strip()
    server = start_server(program_env)
    try:
        answer = chat(server, key, "smollm", max_tokens=8, temperature=0)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].strip()
        assert chat(server, key, "other").status_code == 200
        states = {
            d["name"]: d["observed_state"]
            for d in json.loads(run("deployment", "list", "--json").out)
        }
        assert states == {"smollm": "stopped", "other": "ready"}
        assert "stopped smollm instead of parking: its engine cannot park" in run("events").out
        again = chat(server, key, "smollm", max_tokens=4)
        assert again.status_code == 200, again.text
        states = {
            d["name"]: d["observed_state"]
            for d in json.loads(run("deployment", "list", "--json").out)
        }
        assert states["smollm"] == "ready"
        assert states["other"] == "parked"
    finally:
        stop_server(server, signal.SIGTERM)


def _waiting_for(server, model):
    """How many requests the gateway holds waiting for ``model`` (its /metrics gauge)."""
    text = httpx.get(f"{server.base_url}/metrics",
                     headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text  # fmt: skip
    found = re.search(rf'^capyctl_waiting_requests{{model="{model}"}} (\d+)', text, re.M)
    return int(found.group(1)) if found else 0


def test_a_client_that_hangs_up_while_queued_leaves_the_queue_at_once(served, program_env):
    """q lets 5 wait while its start is held. Five clients that wait and then hang up give
    their places back at once (they held them until the start ended: newcomers were told
    queue_full meanwhile); five others then wait, and are answered once the start ends."""
    server, key, _, _ = served
    ask = {"model": "q", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url, auth = f"{server.base_url}/v1/chat/completions", {"Authorization": f"Bearer {key}"}

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as leavers:
            gone = [asyncio.ensure_future(leavers.post(url, json=ask, headers=auth))
                    for _ in range(5)]  # fmt: skip
            while await asyncio.to_thread(_waiting_for, server, "q") < 5:
                await asyncio.sleep(0.1)
            # (the start moves q to starting on the control plane's thread: on a busy
            # machine the five may be queued a moment before it has)
            for _ in range(100):
                shown = (await leavers.get(f"{server.base_url}/v1/models/q", headers=auth)).json()
                if shown["state"] != "stopped":
                    break
                await asyncio.sleep(0.1)
            assert (shown["state"], shown["waiting"]) == ("starting", 5)
            for request in gone:
                request.cancel()  # the client hangs up: its connection is closed
            await asyncio.gather(*gone, return_exceptions=True)
        await asyncio.to_thread(
            wait_until, lambda: _waiting_for(server, "q") == 0, "the places to be given back"
        )
        async with httpx.AsyncClient(timeout=120) as client:
            stay = [asyncio.ensure_future(client.post(url, json=ask, headers=auth))
                    for _ in range(5)]  # fmt: skip
            while await asyncio.to_thread(_waiting_for, server, "q") < 5:
                assert not any(s.done() for s in stay), [s.result().text for s in stay if s.done()]
                await asyncio.sleep(0.1)
            load_gate(program_env).touch()
            return list(await asyncio.gather(*stay))

    answers = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]


def test_keys_share_a_full_queue(served, program_env):
    """q lets 5 wait while its start is held, and one key's 5 fill it. On the old code
    another key's request was told queue_full; now it takes the newest place of the key
    that holds the most (that request gets 429 queue_full with Retry-After), waits, and
    is answered with the first key's other four once the start ends."""
    server, key, _, run = served
    other = run("key", "create", "--user", "admin", "--name", "other").out.strip()
    ask = {"model": "q", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{server.base_url}/v1/chat/completions"

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            mine = {"Authorization": f"Bearer {key}"}
            flood = [asyncio.ensure_future(client.post(url, json=ask, headers=mine))
                     for _ in range(5)]  # fmt: skip
            while await asyncio.to_thread(_waiting_for, server, "q") < 5:
                await asyncio.sleep(0.1)
            one = asyncio.ensure_future(
                client.post(url, json=ask, headers={"Authorization": f"Bearer {other}"})
            )
            done, _ = await asyncio.wait(flood, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1  # one of the flood gave way,
            assert not one.done()  # and the other key's waits
            load_gate(program_env).touch()
            return list(await asyncio.gather(*flood)), await one

    flood, one = asyncio.run(scenario())
    assert one.status_code == 200, one.text
    assert sorted(a.status_code for a in flood) == [200] * 4 + [429]
    (refused,) = [a for a in flood if a.status_code == 429]
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.headers["retry-after"] == "1"
