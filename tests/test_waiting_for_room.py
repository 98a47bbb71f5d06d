"""A request whose model cannot be placed now only because of something that will pass
waits for it and is answered; only what can never fit is refused at once."""

import contextlib
import json
import re
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import run_program, run_programs, start_server, stop_server

pytestmark = pytest.mark.e2e

SIM = f"{sys.executable} -m hostagent.sim vllm"


@contextlib.contextmanager
def serving(program_env, setup):
    """Run the ``setup`` commands (the last makes a key), then serve: the server, the key."""
    results = run_programs(program_env, *setup)
    for argv, result in zip(setup, results, strict=True):
        assert result.code == 0, (argv, result.err)
    server = start_server(program_env)
    try:
        yield server, results[-1].out.strip()
    finally:
        stop_server(server, signal.SIGTERM)


@pytest.fixture
def two_that_do_not_fit(program_env):
    """Models ``a``, ``b`` and ``c`` of 16 GiB each on one 24 GiB GPU (one at a time),
    each kept at least 3 s once ready; ``c`` waits at most 1 s; a key."""
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    setup: list[list[str]] = [
        ["engine", "add", "sim", "--kind", "vllm", "--command", SIM],
        *(["deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
           "--gpu-memory", "16GiB", "--min-ready-seconds", "3",
           *(["--wake-timeout", "1"] if name == "c" else [])] for name in ("a", "b", "c")),
        ["key", "create", "--user", "admin"],
    ]  # fmt: skip
    with serving(program_env, setup) as (server, key):
        yield server, key, program_env


def test_a_request_waits_while_the_model_in_the_way_is_inside_its_residency(
    two_that_do_not_fit,
):
    """Ask ``a``, then ``b`` a moment later: ``b`` was refused at once (503 no_capacity,
    'in the way: a (ready for less than 10s)', x-should-retry: false) though in seconds it
    would fit. It now waits until ``a`` may be parked, and is answered: through the
    official openai client, plain and streaming."""
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    server, key, env = two_that_do_not_fit
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                           timeout=60)  # fmt: skip
    hello: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
    first = client.chat.completions.with_raw_response.create(model="a", messages=hello,
                                                             max_tokens=2)  # fmt: skip
    assert re.fullmatch(r"started a \d+ ms", first.headers["x-capyctl-switch"])
    raw = client.chat.completions.with_raw_response.create(model="b", messages=hello,
                                                           max_tokens=2)  # fmt: skip
    assert int(raw.headers["x-capyctl-queued-ms"]) > 0  # how long it waited
    # What its wait switched, step by step.
    assert re.fullmatch(
        r"parked a \(ram\) \d+ ms; started b \d+ ms", raw.headers["x-capyctl-switch"]
    )
    assert raw.parse().choices[0].message.content == "tok0 tok1"
    again = client.chat.completions.with_raw_response.create(model="b", messages=hello,
                                                             max_tokens=2)  # fmt: skip
    assert "x-capyctl-switch" not in again.headers  # ready: nothing switched for it
    # And back to a, streaming, while b is inside its own 3 s.
    chunks = list(client.chat.completions.create(model="a", messages=hello, max_tokens=2,
                                                 stream=True))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1"
    events = run_program(env, "events", "--limit", "20").out
    made_room = re.findall(r" parked (\w) \(\w+\) to make room for (\w) ", events)
    assert made_room == [("a", "b"), ("b", "a")], events
    assert "no_capacity" not in events


def test_a_wait_for_room_ends_at_the_wake_timeout_saying_what_was_in_the_way(
    two_that_do_not_fit,
):
    """``c`` waits at most 1 s and ``a`` is kept 3 s: 504 wake_timeout naming what was in
    the way, with Retry-After. (What can never fit is refused at once: test_switching's
    pinned model, test_gateway's model larger than the GPU.)"""
    server, key, _ = two_that_do_not_fit
    headers = {"Authorization": f"Bearer {key}"}

    def ask(model: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers,
                          timeout=60)  # fmt: skip

    assert ask("a").status_code == 200
    waited = ask("c")
    assert waited.status_code == 504, waited.text
    error = waited.json()["error"]
    assert error["code"] == "wake_timeout"
    assert error["message"] == (
        "`c` did not become ready within 1s: c needs 16.0 GiB per GPU and waits for room; in "
        "the way: a (ready for less than 3s)"
    )
    assert waited.headers["retry-after"] == "1"
    assert int(waited.headers["x-capyctl-queued-ms"]) >= 1000  # its whole wake timeout


@pytest.fixture
def slow_to_start(program_env):
    """``slow`` takes 31 s to start; ``doomed`` fails 12 s into its start; a key."""
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    fails = (f"{sys.executable} -c 'import sys, time; time.sleep(12); "
             "print(\"no such model file\"); sys.exit(3)'")  # fmt: skip
    setup: list[list[str]] = [
        ["engine", "add", "slow", "--kind", "vllm", "--command", SIM,
         "--env", "CAPYCTL_SIM_LOAD_SECONDS=31"],
        ["deployment", "add", "slow", "--engine", "slow", "--source", "m", "--gpu-memory", "4GiB"],
        ["engine", "add", "fails", "--kind", "llamacpp", "--command", fails],
        ["deployment", "add", "doomed", "--engine", "fails", "--source", "m", "--gpus", "0"],
        ["key", "create", "--user", "admin"],
    ]  # fmt: skip
    with serving(program_env, setup) as served:
        yield served


def test_a_stream_that_waits_gets_keepalive_comments_then_its_answer(slow_to_start):
    """A streaming request waits 31 s for a start, with a client that gives up after 15 s
    without a byte (as proxies that cut idle connections do): every 10 s it gets an SSE
    comment line saying what it waits for, then its answer. A stream whose wait fails after
    its head went out ends with the error as its ``data:`` line."""
    server, key = slow_to_start
    lines: dict[str, list[str]] = {}

    def stream(model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"},
                          timeout=httpx.Timeout(15, connect=5)) as reply:  # fmt: skip
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines[model] = [line for line in reply.iter_lines() if line]

    both = [threading.Thread(target=stream, args=(m,)) for m in ("slow", "doomed")]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join(timeout=120)
    slow, doomed = lines["slow"], lines["doomed"]
    waiting = [line for line in slow if line.startswith(":")]
    assert len(waiting) == 3, slow
    assert re.fullmatch(r": waiting for slow: starting, 1\d\.\d s", waiting[0]), waiting
    data = [json.loads(line[6:]) for line in slow if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data) == "tok0 tok1"
    assert slow[-1] == "data: [DONE]"
    assert doomed[0].startswith(": waiting for doomed: "), doomed
    error = json.loads(doomed[-1].removeprefix("data: "))["error"]
    assert error["code"] == "engine_failed", doomed
    assert "no such model file" in error["message"]


def test_a_wait_for_room_that_everyone_left_moves_nothing(two_that_do_not_fit):
    """``b``'s only request hangs up while ``b`` waits for ``a``'s 3 s: once they have
    passed, ``a`` is not parked, nor ``b`` started, for nobody."""
    server, key, env = two_that_do_not_fit
    headers = {"Authorization": f"Bearer {key}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{server.base_url}/v1/chat/completions"
    assert httpx.post(url, json={**body, "model": "a"}, headers=headers, timeout=60).is_success
    ready_at = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up, and hangs up
        httpx.post(url, json={**body, "model": "b"}, headers=headers, timeout=1)
    # Here the time is the point: past a's 3 s, and a few of b's tries after them.
    time.sleep(max(0.0, ready_at + 3 + 2 - time.monotonic()))
    rows = {d["name"]: d for d in json.loads(run_program(env, "deployment", "list",
                                                         "--json").out)}  # fmt: skip
    assert (rows["a"]["observed_state"], rows["b"]["observed_state"]) == ("ready", "stopped")
    assert "to make room for b" not in run_program(env, "events", "--limit", "20").out
