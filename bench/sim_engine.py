"""How fast the simulated engine answers: small JSON chat requests at a few concurrencies.

It serves as the upstream of the proxy benchmarks, so it must not be their bottleneck.
Run: .venv/bin/python bench/sim_engine.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import aiohttp

from hostagent.runtime import free_port


async def load(url: str, key: str, concurrency: int, seconds: float) -> tuple[int, list[float]]:
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, headers={"Authorization": f"Bearer {key}"}
    ) as session:

        async def worker() -> None:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"status {response.status}")
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    port = free_port()
    key = "bench-key"
    engine = subprocess.Popen(
        [sys.executable, "-m", "hostagent.sim", "vllm", "serve", "/m", "--served-model-name",
         "bench", "--host", "127.0.0.1", "--port", str(port), "--api-key", key],
        env={**os.environ, "CAPYCTL_SIM_COMPLETION_TOKENS": "4"},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        print(f"simulated vLLM engine, small JSON chat, {args.seconds:.0f}s per level")
        print(f"{'concurrency':>11}  {'req/s':>8}  {'p50 ms':>7}  {'p99 ms':>7}")
        for concurrency in (1, 32, 256):
            count, latencies = asyncio.run(load(url, key, concurrency, args.seconds))
            latencies.sort()
            p50 = statistics.median(latencies) * 1000
            p99 = latencies[int(len(latencies) * 0.99) - 1] * 1000
            print(f"{concurrency:>11}  {count / args.seconds:>8.0f}  {p50:>7.2f}  {p99:>7.2f}")
    finally:
        engine.terminate()
        engine.wait()


if __name__ == "__main__":
    main()
