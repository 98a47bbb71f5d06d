"""The /v1 gateway against the engine itself, in one run: req/s, p50/p99 and the ratio.

A simulated engine with no delay is the upstream. The same load goes to it directly and
through CapyCTL (standalone, uvicorn): small JSON chat at concurrency 1, 32 and 256, then
128 clients streaming paced answers (50 chunks, 20 ms apart) one after another, with the
first-chunk latency of the first 128 (all started at once) and of the later ones apart.

Run: .venv/bin/python bench/proxy.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

from hostagent.runtime import free_port


def capyctl(env: dict[str, str], *argv: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "capyctl"), *argv],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


async def small_json(
    url: str, key: str, model: str, concurrency: int, seconds: float
) -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def worker() -> None:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"status {response.status}: {await response.text()}")
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


@dataclass
class StreamRun:
    seconds: float  # from the first start to the last stream's end
    streams: int
    burst_firsts: list[float]  # first-chunk latency of the first 128, started at once
    steady_firsts: list[float]  # of every later stream, each started as another ended


async def paced_streams(url: str, key: str, model: str, streams: int, seconds: float) -> StreamRun:
    """``streams`` clients, each streaming one answer after another for ``seconds``."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    run = StreamRun(0.0, 0, [], [])
    connector = aiohttp.TCPConnector(limit=streams)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def client() -> None:
            firsts = run.burst_firsts
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                chunks = 0
                async with session.post(url, json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            if chunks == 0:
                                firsts.append(time.perf_counter() - started)
                            chunks += 1
                if chunks < 50:
                    raise RuntimeError(f"a stream ended after {chunks} chunks")
                run.streams += 1
                firsts = run.steady_firsts

        started = time.perf_counter()
        deadline = started + seconds
        await asyncio.gather(*(client() for _ in range(streams)))
        run.seconds = time.perf_counter() - started
    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)] * 1000


def engine_address(env: dict[str, str], name: str) -> tuple[str, str]:
    """The engine's loopback port and launch key, read from CapyCTL's database."""
    os.environ.update({k: v for k, v in env.items() if k.startswith("CAPYCTL_")})
    os.environ["DJANGO_SETTINGS_MODULE"] = "capyctl.settings"
    import django

    django.setup()
    from capyctl.deployments.models import Instance

    instance = Instance.objects.filter(deployment__name=name, state="running").get()
    return f"http://127.0.0.1:{instance.port}", instance.launch_key


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    data = tempfile.mkdtemp(prefix="capyctl-proxy-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env.update({"CAPYCTL_DATA_DIR": data, "CAPYCTL_LOG_LEVEL": "WARNING"})
    sim = f"{sys.executable} -m hostagent.sim llamacpp"
    capyctl(env, "engine", "add", "sim", "--kind", "llamacpp", "--command", sim,
            "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=4")  # fmt: skip
    capyctl(env, "engine", "add", "paced", "--kind", "llamacpp", "--command", sim,
            "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=50", "--env", "CAPYCTL_SIM_TOKENS_PER_SECOND=50")  # fmt: skip
    capyctl(env, "deployment", "add", "json", "--engine", "sim", "--source", "/m", "--gpus", "0")
    capyctl(
        env, "deployment", "add", "stream", "--engine", "paced", "--source", "/m", "--gpus", "0"
    )
    key = capyctl(env, "key", "create", "--user", "admin")
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "capyctl"), "start", "standalone",
         "--listen", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        for model in ("json", "stream"):  # start both engines before measuring
            httpx.post(
                f"{base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                timeout=60,
            ).raise_for_status()
        direct_json, json_key = engine_address(env, "json")
        direct_stream, stream_key = engine_address(env, "stream")
        print(
            f"small JSON chat, {args.seconds:.0f}s per run (2 cores: client, CapyCTL and engine share them)"
        )
        print(f"{'concurrency':>11}  {'direct req/s':>12}  {'capyctl req/s':>13}  {'ratio':>6}  "
              f"{'direct p50/p99 ms':>18}  {'capyctl p50/p99 ms':>19}")  # fmt: skip
        for concurrency in (1, 32, 256):
            direct = asyncio.run(small_json(f"{direct_json}/v1/chat/completions", json_key, "json",
                                            concurrency, args.seconds))  # fmt: skip
            proxied = asyncio.run(small_json(f"{base}/v1/chat/completions", key, "json",
                                             concurrency, args.seconds))  # fmt: skip
            d_rate, p_rate = len(direct) / args.seconds, len(proxied) / args.seconds
            print(f"{concurrency:>11}  {d_rate:>12.0f}  {p_rate:>13.0f}  {p_rate / d_rate:>6.2f}  "
                  f"{pct(direct, 0.5):>8.1f}/{pct(direct, 0.99):<9.1f}  "
                  f"{pct(proxied, 0.5):>8.1f}/{pct(proxied, 0.99):<9.1f}")  # fmt: skip
        seconds = max(args.seconds, 3.0)
        direct = asyncio.run(paced_streams(f"{direct_stream}/v1/chat/completions", stream_key,
                                           "stream", 128, seconds))  # fmt: skip
        proxied = asyncio.run(paced_streams(f"{base}/v1/chat/completions", key, "stream", 128,
                                            seconds))  # fmt: skip
        d_rate, p_rate = direct.streams / direct.seconds, proxied.streams / proxied.seconds
        print(f"\n128 paced streams (50 chunks, 20 ms apart), each client streaming one after another "
              f"for {seconds:.0f}s")  # fmt: skip
        print(
            f"  streams/s: direct {d_rate:.1f}, capyctl {p_rate:.1f}, ratio {p_rate / d_rate:.2f}"
        )
        for label, d_firsts, p_firsts in (
            ("steady", direct.steady_firsts, proxied.steady_firsts),
            ("burst (128 at once)", direct.burst_firsts, proxied.burst_firsts),
        ):
            d50, p50 = statistics.median(d_firsts) * 1000, statistics.median(p_firsts) * 1000
            print(f"  first chunk p50, {label}: direct {d50:.1f} ms, capyctl {p50:.1f} ms "
                  f"(overhead {p50 - d50:.1f} ms); p99 direct {pct(d_firsts, 0.99):.1f} ms, "
                  f"capyctl {pct(p_firsts, 0.99):.1f} ms")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
