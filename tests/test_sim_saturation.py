"""The simulated engines saturate (hostagent/sim/load.py): at most
CAPYCTL_SIM_MAX_CONCURRENCY requests run, the rest wait first in, first out, and a queued
client that leaves takes no slot; a prefix cache (CAPYCTL_SIM_PREFIX_CACHE) spares the
prefill time of a prompt's cached blocks. Both are read on /metrics as vLLM names them.
Moments are caught with the request gate, and times are only bounded from below."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from hostagent.sim.options import parse_options, read_knobs
from hostagent.sim.server import SimEngine

Client = aiohttp.ClientSession


@asynccontextmanager
async def engine(
    monkeypatch: pytest.MonkeyPatch,
    kind: str = "vllm",
    *,
    handler_cancellation: bool = False,
    **env: object,
) -> AsyncIterator[Client]:
    """A simulated engine in this process, with the knobs ``env`` gives (CAPYCTL_SIM_ +),
    served as its process serves it: a handler goes on when its client leaves, unless
    ``handler_cancellation`` (aiohttp's test server's way)."""
    for name, value in env.items():
        monkeypatch.setenv(f"CAPYCTL_SIM_{name}", str(value))
    argv = ["vllm", "serve", "m"] if kind == "vllm" else ["tensorfold", "serve", "m"]
    sim = SimEngine(parse_options(argv), read_knobs())
    sim.ready.set()
    runner = web.AppRunner(sim.app(), access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession(f"http://{host}:{port}") as client:
            yield client
    finally:
        await runner.cleanup()


async def metrics(client: Client) -> dict[str, float]:
    """The saturation samples, by name without the ``vllm:`` or ``sim:`` prefix."""
    text = await (await client.get("/metrics")).text()
    samples = [line for line in text.splitlines() if line.startswith(("vllm:", "sim:"))]
    return {
        line.split(":", 1)[1].split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in samples
    }


async def until(client: Client, holds: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The engine's metrics once ``holds`` is true of them (a generous deadline: a busy
    machine only makes it come later)."""
    deadline = asyncio.get_running_loop().time() + 15
    while not holds(found := await metrics(client)):
        assert asyncio.get_running_loop().time() < deadline, found
        await asyncio.sleep(0.02)
    return found


async def ask(client: Client, *, stream: bool = False, prompt: str = "hi") -> float:
    """A chat request read to its end: the loop's time when it ended."""
    answer = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": prompt}], "stream": stream},
    )
    assert answer.status == 200
    text = await answer.text()
    assert text.rstrip().endswith("data: [DONE]") if stream else "tok7" in text
    return asyncio.get_running_loop().time()


def load(found: dict[str, float]) -> tuple[float, float]:
    return found["num_requests_running"], found["num_requests_waiting"]


def taken(count: int) -> Callable[[dict[str, float]], bool]:
    """True of the metrics once the engine holds ``count`` requests, running or waiting."""
    return lambda found: sum(load(found)) == count


async def test_six_requests_on_two_slots_run_in_three_waves_in_arrival_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    seconds = 0.1  # 8 tokens at 80 a second: each request holds its slot this long
    async with engine(
        monkeypatch, MAX_CONCURRENCY=2, TOKENS_PER_SECOND=80, REQUEST_GATE=gate
    ) as client:
        tasks = []
        for i in range(6):  # one at a time, so their order of arrival is known
            tasks.append(asyncio.create_task(ask(client, stream=i % 2 == 1)))
            found = await until(client, taken(i + 1))
        assert load(found) == (2, 4)  # held: two run, four wait
        gate.touch()
        opened = asyncio.get_running_loop().time()
        ended = await asyncio.gather(*tasks)
        assert load(await metrics(client)) == (0, 0)
    # Request i runs in wave i // 2 + 1, so it cannot end before that many request times.
    for i, end in enumerate(ended):
        assert end - opened >= 0.9 * seconds * (i // 2 + 1), (i, [e - opened for e in ended])


@pytest.mark.parametrize("handler_cancellation", [False, True])
async def test_a_queued_client_that_leaves_takes_no_slot_and_the_rest_complete(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, handler_cancellation: bool
) -> None:
    gate = tmp_path / "gate"
    async with engine(
        monkeypatch,
        MAX_CONCURRENCY=1,
        REQUEST_GATE=gate,
        handler_cancellation=handler_cancellation,
    ) as client:
        first = asyncio.create_task(ask(client))
        await until(client, lambda m: load(m) == (1, 0))
        # The one that leaves has a connection of its own, closed when it goes: a cancelled
        # request alone may leave its connection to the client's pool, open.
        leaver = aiohttp.ClientSession(client._base_url)
        leaving = asyncio.create_task(ask(leaver, stream=True))
        await until(client, lambda m: load(m) == (1, 1))
        last = asyncio.create_task(ask(client))
        await until(client, lambda m: load(m) == (1, 2))
        leaving.cancel()
        await leaver.close()  # its connection closes while it waits
        found = await until(client, lambda m: load(m) != (1, 2))
        assert load(found) == (1, 1)  # the first still runs alone, the last still waits
        gate.touch()
        await asyncio.gather(first, last)
        assert load(await metrics(client)) == (0, 0)
        # The slot is whole: two more requests still run one at a time.
        gate.unlink()
        again = [asyncio.create_task(ask(client)) for _ in range(2)]
        assert load(await until(client, taken(2))) == (1, 1)
        gate.touch()
        await asyncio.gather(*again)


async def test_without_a_limit_every_request_runs_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    async with engine(monkeypatch, "tensorfold", REQUEST_GATE=gate) as client:
        tasks = [asyncio.create_task(ask(client)) for _ in range(5)]
        await until(client, lambda m: load(m) == (5, 0))
        gate.touch()
        await asyncio.gather(*tasks)
        found = await metrics(client)
        assert (found["prefix_cache_queries_total"], found["prefix_cache_hits_total"]) == (0, 0)


def words(count: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


async def test_a_prompt_served_again_hits_its_cached_blocks_and_skips_their_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rate = 1000  # prompt tokens prefilled a second
    prompt = words(325)  # 20 whole blocks of 16, and 5 tokens over
    async with engine(monkeypatch, PREFIX_CACHE=4096, PREFILL_TOKENS_PER_SECOND=rate) as client:
        loop = asyncio.get_running_loop()
        began = loop.time()
        cold = await ask(client, prompt=prompt) - began
        found = await metrics(client)
        assert (found["prefix_cache_queries_total"], found["prefix_cache_hits_total"]) == (325, 0)
        assert cold >= 0.9 * 325 / rate

        # Again, streamed: its first token comes after the prefill of the 5 tokens missed.
        began = loop.time()
        answer = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"content": prompt}], "stream": True},
        )
        await answer.content.readline()
        warm = loop.time() - began
        await answer.read()
        found = await metrics(client)
        assert (found["prefix_cache_queries_total"], found["prefix_cache_hits_total"]) == (650, 320)
        assert warm < cold

        await ask(client, prompt="x " + prompt)  # another first token: nothing cached
        assert (await metrics(client))["prefix_cache_hits_total"] == 320


async def test_a_blocks_hash_covers_everything_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = words(16, "a"), words(16, "b")
    async with engine(monkeypatch, PREFIX_CACHE=4096) as client:
        await ask(client, prompt=f"{a} {b}")
        await ask(client, prompt=f"{a} {a}")  # its second block is `a` after `a`: not cached
        assert (await metrics(client))["prefix_cache_hits_total"] == 16


async def test_the_least_recently_used_blocks_are_evicted_beyond_the_caches_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c = (words(32, tag) for tag in "abc")  # two blocks each; the cache holds four
    async with engine(monkeypatch, PREFIX_CACHE=64) as client:
        hits = []
        for prompt in (a, b, a, c, a, b):  # `a` used again before `c` comes: `b` goes
            before = (await metrics(client))["prefix_cache_hits_total"]
            await ask(client, prompt=prompt)
            hits.append((await metrics(client))["prefix_cache_hits_total"] - before)
        assert hits == [0, 0, 32, 0, 32, 0]


async def test_vllm_names_its_samples_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    async with engine(monkeypatch) as client:
        text = await (await client.get("/metrics")).text()
    for line in (
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_waiting{model_name="m",engine="0"} 0.0',
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 0.0',
    ):
        assert line in text.splitlines()
