"""The /v1 gateway against the engine itself, in one run: req/s, p50/p99 and the ratio.

A simulated engine with no delay is the upstream. The same load goes to it directly and
through CapyCTL (standalone, uvicorn): small JSON chat at concurrency 1, 32 and 256; then
128 clients streaming paced answers (50 chunks, 20 ms apart) one after another, their
starts spread over one stream's length as in a steady load; then 128 streams started at
the same instant, each run with its first-chunk latency.

The engines listen on Unix sockets (the simulated llama-server binds one, as llama-server
builds since 2025 do); ``--tcp-engines`` gives them a build without, on loopback TCP, to
compare the two.

Run: .venv/bin/python bench/proxy.py [--seconds 5] [--tcp-engines]
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
from typing import Any

import aiohttp
import httpx

from hostagent.runtime import free_port

STREAM_SECONDS = 1.0  # 50 chunks, 20 ms apart


def capyctl(env: dict[str, str], *argv: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "capyctl"), *argv],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def connector_for(url: str, limit: int) -> tuple[str, aiohttp.BaseConnector]:
    """The URL to ask and a connector: an engine's socket (``unix:PATH|/route``) or TCP."""
    if url.startswith("unix:"):
        path, _, route = url.removeprefix("unix:").partition("|")
        return f"http://localhost{route}", aiohttp.UnixConnector(path=path, limit=limit)
    return url, aiohttp.TCPConnector(limit=limit)


async def small_json(
    url: str, key: str, model: str, concurrency: int, seconds: float
) -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    url, connector = connector_for(url, concurrency)
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
    firsts: list[float]  # each stream's first-chunk latency


async def paced_streams(
    url: str, key: str, model: str, clients: int, seconds: float, *, burst: bool = False
) -> StreamRun:
    """``clients`` clients, each streaming one answer after another for ``seconds``, their
    starts spread over one stream's length (as streams arrive in a steady load); with
    ``burst``, all start at once and stream once."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    run = StreamRun(0.0, 0, [])
    url, connector = connector_for(url, clients)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def client(index: int) -> None:
            if not burst:
                await asyncio.sleep(index * STREAM_SECONDS / clients)
            while True:
                started = time.perf_counter()
                chunks = 0
                async with session.post(url, json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            if chunks == 0:
                                run.firsts.append(time.perf_counter() - started)
                            chunks += 1
                if chunks < 50:
                    raise RuntimeError(f"a stream ended after {chunks} chunks")
                run.streams += 1
                if burst or time.perf_counter() >= deadline:
                    return

        started = time.perf_counter()
        deadline = started + seconds
        await asyncio.gather(*(client(i) for i in range(clients)))
        run.seconds = time.perf_counter() - started
    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)] * 1000


def engine_address(env: dict[str, str], name: str) -> tuple[str, str]:
    """Where the engine listens (``unix:PATH|`` for its socket, else its loopback port)
    and its launch key, read from CapyCTL's database."""
    os.environ.update({k: v for k, v in env.items() if k.startswith("CAPYCTL_")})
    os.environ["DJANGO_SETTINGS_MODULE"] = "capyctl.settings"
    import django

    django.setup()
    from capyctl.deployments.models import Instance

    instance = Instance.objects.filter(deployment__name=name, state="running").get()
    if instance.socket_path:
        return f"unix:{instance.socket_path}|", instance.launch_key
    return f"http://127.0.0.1:{instance.port}", instance.launch_key


def json_level(
    direct: tuple[str, str], proxy: tuple[str, str], concurrency: int, args: Any
) -> None:
    """One line of the JSON table. Direct and proxied runs alternate, so that a slow
    moment of this shared machine falls on both; the ratio is the median of the rounds'."""
    direct_times: list[float] = []
    proxied: list[float] = []
    ratios = []
    each = args.seconds / args.rounds
    for _ in range(args.rounds):
        d = asyncio.run(small_json(direct[0], direct[1], "json", concurrency, each))
        p = asyncio.run(small_json(proxy[0], proxy[1], "json", concurrency, each))
        ratios.append(len(p) / len(d))
        direct_times += d
        proxied += p
    d_rate, p_rate = len(direct_times) / args.seconds, len(proxied) / args.seconds
    print(f"{concurrency:>11}  {d_rate:>12.0f}  {p_rate:>13.0f}  {statistics.median(ratios):>6.2f}  "
          f"{pct(direct_times, 0.5):>8.1f}/{pct(direct_times, 0.99):<9.1f}  "
          f"{pct(proxied, 0.5):>8.1f}/{pct(proxied, 0.99):<9.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4, help="direct/proxied alternations")
    parser.add_argument("--tcp-engines", action="store_true",
                        help="engines without Unix sockets: on loopback TCP")  # fmt: skip
    args = parser.parse_args()
    data = tempfile.mkdtemp(prefix="capyctl-proxy-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env.update({"CAPYCTL_DATA_DIR": data, "CAPYCTL_LOG_LEVEL": "WARNING"})
    sim = f"{sys.executable} -m hostagent.sim llamacpp"
    tcp = ["--env", "CAPYCTL_SIM_NO_SOCKET=1"] if args.tcp_engines else []
    capyctl(env, "engine", "add", "sim", "--kind", "llamacpp", "--command", sim,
            "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=4", *tcp)  # fmt: skip
    capyctl(env, "engine", "add", "paced", "--kind", "llamacpp", "--command", sim,
            "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=50", "--env", "CAPYCTL_SIM_TOKENS_PER_SECOND=50",
            *tcp)  # fmt: skip
    capyctl(env, "deployment", "add", "json", "--engine", "sim", "--source", "m", "--gpus", "0")
    capyctl(env, "deployment", "add", "stream", "--engine", "paced", "--source", "m", "--gpus", "0")
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
            json_level((f"{direct_json}/v1/chat/completions", json_key),
                       (f"{base}/v1/chat/completions", key), concurrency, args)  # fmt: skip
        seconds = max(args.seconds, 3.0)
        d_url, p_url = f"{direct_stream}/v1/chat/completions", f"{base}/v1/chat/completions"
        runs = {
            (way, burst): asyncio.run(paced_streams(url, k, "stream", 128, seconds, burst=burst))
            for burst in (False, True)
            for way, url, k in (("direct", d_url, stream_key), ("capyctl", p_url, key))
        }
        direct, proxied = runs["direct", False], runs["capyctl", False]
        d_rate, p_rate = direct.streams / direct.seconds, proxied.streams / proxied.seconds
        print(f"\n128 clients streaming paced answers (50 chunks, 20 ms apart) one after another "
              f"for {seconds:.0f}s, their starts spread over one stream's length")  # fmt: skip
        print(
            f"  streams/s: direct {d_rate:.1f}, capyctl {p_rate:.1f}, ratio {p_rate / d_rate:.2f}"
        )
        for label, d_firsts, p_firsts in (
            ("steady", direct.firsts, proxied.firsts),
            ("128 started at once", runs["direct", True].firsts, runs["capyctl", True].firsts),
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
