"""A valid key under the slow-connection attack: how long /v1 takes, and what the server
holds meanwhile.

One address (127.0.0.1) keeps thousands of connections open the cheap way: a POST whose
``Content-Length`` promises 100,000 bytes and whose body comes a byte every 5 s, plus
connections that send nothing; each one closed is opened again a second later. Another
address (127.0.0.2) asks ``GET /v1/models`` with a valid key four times a second, each
time on a new connection, and ``/healthz`` as often. Printed: those answers' statuses and
times, the server's resident memory and the free space of its temp dir, sampled each
second, and what the attacker was answered. CapyCTL runs standalone with its defaults.

Run: .venv/bin/python bench/slow_clients.py [--seconds 60] [--slow 4100] [--idle 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from hostagent.runtime import free_port

HEAD = (
    b"POST /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100000\r\n\r\n"
)


def capyctl(env: dict[str, str], *argv: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "capyctl"), *argv],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_mib(folder: str) -> float:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize / 1024**2


class Attack:
    def __init__(self, port: int, stop: asyncio.Event) -> None:
        self.port, self.stop = port, stop
        self.answers: Counter[str] = Counter()
        self.open = 0
        self.most_open = 0

    async def connection(self, slow: bool) -> None:
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=("127.0.0.1", 0)
                )
            except OSError:
                self.answers["connect failed"] += 1
                await asyncio.sleep(1)
                continue
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            try:
                if slow:
                    writer.write(HEAD)
                while not self.stop.is_set():
                    try:
                        said = await asyncio.wait_for(reader.read(64), 5)
                    except TimeoutError:
                        if slow:
                            writer.write(b"a")
                        continue
                    status = said.split(b"\r\n", 1)[0][9:12].decode() or "closed"
                    self.answers[f"{'slow' if slow else 'idle'} {status}"] += 1
                    break
            except OSError:
                self.answers["reset"] += 1
            finally:
                self.open -= 1
                writer.close()
            await asyncio.sleep(1)


async def attack(port: int, seconds: float, slow: int, idle: int) -> None:
    """The attacker (a process of its own, so that the measuring client's loop is not
    its): prints what it was answered, as JSON, when ``seconds`` have passed."""
    stop = asyncio.Event()
    attack = Attack(port, stop)
    tasks = [asyncio.create_task(attack.connection(True)) for _ in range(slow)]
    tasks += [asyncio.create_task(attack.connection(False)) for _ in range(idle)]
    await asyncio.sleep(seconds)
    stop.set()
    print(json.dumps({"answers": attack.answers, "most_open": attack.most_open,
                      "open_at_end": attack.open}), flush=True)  # fmt: skip
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def held_in(pid: int, folder: str) -> float:
    """MiB of the files under ``folder`` the process holds open, deleted ones too."""
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if str(fd.readlink()).startswith(folder):
                held += fd.stat().st_size
        except OSError:
            continue
    return held / 1024**2


async def measure(base: str, key: str, server_pid: int, temp: str, args: Any) -> None:
    port = int(base.rsplit(":", 1)[1])
    seconds, slow, idle = args.seconds, args.slow, args.idle
    samples = [(rss_mib(server_pid), free_mib(temp), held_in(server_pid, temp))]
    times: dict[str, list[float]] = {"/v1/models": [], "/healthz": []}
    statuses: dict[str, Counter[int]] = {path: Counter() for path in times}
    build_up = 10.0  # every connection opened and sending before measuring
    attacker = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--attack", str(port), "--seconds", str(seconds + build_up),
        "--slow", str(slow), "--idle", str(idle), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(build_up)
    started = time.monotonic()
    next_sample = started + 1
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    while time.monotonic() - started < seconds:
        for path, taken in times.items():
            headers = {"Authorization": f"Bearer {key}"} if path.startswith("/v1") else {}
            async with httpx.AsyncClient(transport=transport, timeout=30) as client:
                asked = time.perf_counter()
                try:
                    status = (await client.get(f"{base}{path}", headers=headers)).status_code
                except httpx.TransportError:
                    status = 0
                taken.append(time.perf_counter() - asked)
                statuses[path][status] += 1
        if time.monotonic() >= next_sample:
            samples.append((rss_mib(server_pid), free_mib(temp), held_in(server_pid, temp)))
            next_sample += 1
        await asyncio.sleep(0.25)
    said, _ = await attacker.communicate()
    report = json.loads(said.decode().strip().splitlines()[-1])
    samples.append((rss_mib(server_pid), free_mib(temp), held_in(server_pid, temp)))
    print(f"attack from 127.0.0.1: {slow} slow bodies (a byte every 5 s) and {idle} silent "
          f"connections, each reopened 1 s after it closes; at most {report['most_open']} "
          f"open at once on the attacker's side, {report['open_at_end']} at the end")  # fmt: skip
    print("  the attacker was answered: "
          + ", ".join(f"{n} {what}" for what, n in sorted(report["answers"].items())))  # fmt: skip
    print(f"from 127.0.0.2, a new connection each time, for {seconds:.0f}s:")
    for path, taken in times.items():
        ms = sorted(t * 1000 for t in taken)
        print(f"  {path:<11} {dict(statuses[path])}  p50 {statistics.median(ms):.1f} ms, "
              f"p99 {ms[max(0, int(len(ms) * 0.99) - 1)]:.1f} ms, max {ms[-1]:.1f} ms")  # fmt: skip
    rss = [s[0] for s in samples]
    free = [s[1] for s in samples]
    held = [s[2] for s in samples]
    print(f"server RSS: {rss[0]:.0f} MiB before the attack, {min(rss[1:]):.0f}-{max(rss[1:]):.0f} "
          f"MiB during it and after")  # fmt: skip
    print(f"server's files open in its temp dir: at most {max(held):.1f} MiB; the temp dir's "
          f"free space moved {min(free) - free[0]:+.1f} MiB at most (a disk others use too)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slow", type=int, default=4100)
    parser.add_argument("--idle", type=int, default=200)
    parser.add_argument("--attack", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        asyncio.run(attack(args.attack, args.seconds, args.slow, args.idle))
        return
    data = tempfile.mkdtemp(prefix="capyctl-slow-")
    temp = str(Path(data) / "tmp")
    Path(temp).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env.update({"CAPYCTL_DATA_DIR": str(Path(data) / "data"), "CAPYCTL_LOG_LEVEL": "ERROR",
                "TMPDIR": temp})  # fmt: skip
    key = capyctl(env, "key", "create", "--user", "admin")
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "capyctl"), "start", "standalone",
         "--listen", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        asyncio.run(measure(base, key, server.pid, temp, args))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
