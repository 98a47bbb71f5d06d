"""Two CapyCTL trees side by side on /v1: which one is faster, in short alternating bursts.

``--old DIR`` is a copy of the ``capyctl`` package as it was (``DIR/capyctl``); the
current tree is the new one. Each runs standalone with the same simulated engine (no
delay) behind a deployment; the same small JSON chat load (``--concurrency`` clients, one
request after another) goes to each in turn for ``--burst`` seconds, ``--rounds`` times,
so a busy moment of a shared machine falls on both alike. Printed: each round's req/s
and the median of the new/old ratios.

Run: .venv/bin/python bench/ab_v1.py --old /tmp/old [--rounds 20] [--burst 1]
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
from pathlib import Path

import aiohttp
import httpx

from hostagent.runtime import free_port

CAPYCTL = str(Path(sys.executable).parent / "capyctl")


def start(old: str | None) -> tuple[subprocess.Popen[bytes], str, str]:
    """A standalone server (the old tree's with ``old``), its /v1 URL and a key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env.update({"CAPYCTL_DATA_DIR": tempfile.mkdtemp(prefix="capyctl-ab-"),
                "CAPYCTL_LOG_LEVEL": "WARNING"})  # fmt: skip
    if old:
        env["PYTHONPATH"] = old
    sim = f"{sys.executable} -m hostagent.sim llamacpp"

    def capyctl(*argv: str) -> str:
        done = subprocess.run([CAPYCTL, *argv], env=env, capture_output=True, text=True,
                              check=True)  # fmt: skip
        return done.stdout.strip()

    capyctl("engine", "add", "sim", "--kind", "llamacpp", "--command", sim,
            "--env", "CAPYCTL_SIM_COMPLETION_TOKENS=4")  # fmt: skip
    capyctl("deployment", "add", "json", "--engine", "sim", "--source", "m", "--gpus", "0")
    key = capyctl("key", "create", "--user", "admin").splitlines()[-1]
    port = free_port()
    server = subprocess.Popen(
        [CAPYCTL, "start", "standalone", "--listen", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
               json={"model": "json", "messages": [{"role": "user", "content": "hi"}]},
               timeout=120).raise_for_status()  # fmt: skip
    return server, f"{base}/v1/chat/completions", key


async def burst(url: str, key: str, concurrency: int, seconds: float) -> float:
    body = {"model": "json", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    done = 0
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"status {response.status}")
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="a folder holding the old capyctl package")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--burst", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    servers = {"old": start(args.old), "new": start(None)}
    rates: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for round_ in range(args.rounds):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for which in order:
                _, url, key = servers[which]
                rates[which].append(asyncio.run(burst(url, key, args.concurrency, args.burst)))
        ratios = [new / old for new, old in zip(rates["new"], rates["old"], strict=True)]
        print(f"small JSON chat on /v1, {args.concurrency} clients, {args.rounds} rounds of "
              f"{args.burst:g} s each, old and new alternating")  # fmt: skip
        for which in ("old", "new"):
            values = rates[which]
            print(f"  {which}: median {statistics.median(values):.0f} req/s "
                  f"(range {min(values):.0f}-{max(values):.0f})")  # fmt: skip
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"  new/old: median {statistics.median(ratios):.3f}, "
              f"quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}")  # fmt: skip
    finally:
        for server, _, _ in servers.values():
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
