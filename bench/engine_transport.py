"""The gateway's hop to an engine: over its Unix socket or to a loopback port.

Two simulated llama-servers with no delay, one on a Unix socket (``--host PATH.sock``) and
one on ``127.0.0.1``, asked by the gateway's own upstream pool (capyctl.gateway.upstream,
keep-alive connections) for a small chat completion, at concurrency 1 and 32. Socket and
TCP runs alternate, so that a slow moment of this shared machine falls on both; the ratio
is the median of the rounds'.

Run: .venv/bin/python bench/engine_transport.py [--seconds 8] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from capyctl.gateway.upstream import UpstreamPool, unix_url
from hostagent.runtime import free_port

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()
HEADERS = [(b"content-type", b"application/json")]


async def load(base: str, concurrency: int, seconds: float) -> list[float]:
    """Requests answered, each one's latency, in ``seconds`` at ``concurrency``."""
    pool = UpstreamPool()
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            async with await pool.request(
                "POST", f"{base}/v1/chat/completions", HEADERS, BODY
            ) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"status {response.status}")
            latencies.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await pool.close()
    return latencies


def start_engine(*where: str) -> subprocess.Popen[bytes]:
    env = {"CAPYCTL_SIM_COMPLETION_TOKENS": "4", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(
        [sys.executable, "-m", "hostagent.sim", "llamacpp", "-m", "m", "--alias", "m", *where],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def wait_answering(base: str) -> None:
    for _ in range(300):
        try:
            await load(base, 1, 0.01)
            return
        except Exception:  # not up yet
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{base} never answered")


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)] * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="capyctl-transport-"))
    folder.chmod(0o700)
    path = folder / "engine.sock"
    port = free_port()
    engines = [start_engine("--host", str(path)), start_engine("--port", str(port))]
    ways = {"socket": unix_url(str(path)), "tcp": f"http://127.0.0.1:{port}"}
    try:
        for base in ways.values():
            asyncio.run(wait_answering(base))
        print("small chat completion through the gateway's upstream pool, "
              f"{args.seconds:.0f}s per level in {args.rounds} alternating rounds")  # fmt: skip
        print(f"{'concurrency':>11}  {'socket req/s':>12}  {'tcp req/s':>9}  {'ratio':>5}  "
              f"{'socket p50/p99 ms':>17}  {'tcp p50/p99 ms':>14}")  # fmt: skip
        each = args.seconds / args.rounds
        for concurrency in (1, 32):
            times: dict[str, list[float]] = {"socket": [], "tcp": []}
            ratios = []
            for _ in range(args.rounds):
                counts = {}
                for way, base in ways.items():
                    done = asyncio.run(load(base, concurrency, each))
                    counts[way] = len(done)
                    times[way] += done
                ratios.append(counts["socket"] / counts["tcp"])
            s, t = times["socket"], times["tcp"]
            print(f"{concurrency:>11}  {len(s) / args.seconds:>12.0f}  "
                  f"{len(t) / args.seconds:>9.0f}  {statistics.median(ratios):>5.2f}  "
                  f"{p(s, 0.5):>8.2f}/{p(s, 0.99):<8.2f}  {p(t, 0.5):>6.2f}/{p(t, 0.99):<7.2f}")  # fmt: skip
    finally:
        for engine in engines:
            engine.terminate()
            engine.wait(timeout=10)


if __name__ == "__main__":
    main()
