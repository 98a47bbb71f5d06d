"""Does the answer to a bad API key tell whether its id exists? Times, in one process, the
refusal of a wrong secret for an id that exists and of an id that does not, alternating,
on the gateway (``GET /v1/models``, its ASGI app called directly) and on REST (``GET
/api/deployments/``, Django's test client), each from an address of its own so that no
throttle steps in.

Two ways to probe: the same bad key again and again ("repeated"), and a new secret (or
a new unknown id) each time ("fresh").

Run: .venv/bin/python bench/key_timing.py [--rounds 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import statistics
import string
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

ALPHABET = string.ascii_lowercase + string.digits


def setup() -> None:
    os.environ.update(
        {
            "CAPYCTL_DATA_DIR": tempfile.mkdtemp(prefix="capyctl-bench-"),
            "CAPYCTL_LOG_LEVEL": "ERROR",
            "DJANGO_SETTINGS_MODULE": "capyctl.settings",
        }
    )
    import django

    django.setup()
    logging.getLogger("django.request").setLevel(logging.ERROR)  # no line per 401
    from capyctl.bootstrap import prepare_standalone

    prepare_standalone()


def unknown_key() -> str:
    return (
        f"capy_{''.join(secrets.choice(ALPHABET) for _ in range(10))}_{secrets.token_urlsafe(32)}"
    )


def wrong_secret(real: str) -> str:
    return f"{real[: len('capy_') + 10]}_{secrets.token_urlsafe(32)}"


class Addresses:
    """A new client address for every request, so no throttle counts them together."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"10.{self.n >> 16 & 255}.{self.n >> 8 & 255}.{self.n & 255}"


def summary(name: str, timings: list[float]) -> str:
    timings = sorted(timings)
    p50 = statistics.median(timings)
    p90 = timings[int(len(timings) * 0.9)]
    return f"{name:<44} p50 {p50 * 1000:7.3f} ms  p90 {p90 * 1000:7.3f} ms"


async def alternate(
    rounds: int, probes: dict[str, Callable[[], Awaitable[int]]]
) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, probe in probes.items():
            began = time.perf_counter()
            status = await probe()
            timings[name].append(time.perf_counter() - began)
            if status != 401:
                raise SystemExit(f"{name}: answered {status}, not 401")
    return timings


async def gateway_probes(rounds: int, real: str) -> dict[str, list[float]]:
    from capyctl.gateway.app import Gateway

    gateway = Gateway()
    address = Addresses()
    repeated_unknown, repeated_wrong = unknown_key(), wrong_secret(real)

    async def call(key: str) -> int:
        scope = {
            "type": "http", "method": "GET", "path": "/v1/models", "raw_path": b"/v1/models",
            "query_string": b"", "headers": [(b"authorization", f"Bearer {key}".encode())],
            "client": (address(), 1),
        }  # fmt: skip
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await gateway(scope, receive, send)
        return int(sent[0]["status"])

    try:
        for _ in range(50):  # warm: the real key's id is in memory, as when it is in use
            await call(real)
        return await alternate(rounds, {
            "gateway: unknown id, repeated": lambda: call(repeated_unknown),
            "gateway: wrong secret, repeated": lambda: call(repeated_wrong),
            "gateway: unknown id, fresh": lambda: call(unknown_key()),
            "gateway: wrong secret, fresh": lambda: call(wrong_secret(real)),
        })  # fmt: skip
    finally:
        await gateway.close()


def rest_probes(rounds: int, real: str) -> dict[str, list[float]]:
    from django.test import Client

    client = Client()
    address = Addresses()
    repeated_unknown, repeated_wrong = unknown_key(), wrong_secret(real)

    def call(key: str) -> int:
        answer = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {key}",
                            HTTP_HOST="localhost", REMOTE_ADDR=address())  # fmt: skip
        return int(answer.status_code)

    timings: dict[str, list[float]] = {}
    probes: dict[str, Callable[[], int]] = {
        "rest: unknown id, repeated": lambda: call(repeated_unknown),
        "rest: wrong secret, repeated": lambda: call(repeated_wrong),
        "rest: unknown id, fresh": lambda: call(unknown_key()),
        "rest: wrong secret, fresh": lambda: call(wrong_secret(real)),
    }  # fmt: skip
    for _ in range(rounds):
        for name, probe in probes.items():
            began = time.perf_counter()
            status = probe()
            timings.setdefault(name, []).append(time.perf_counter() - began)
            if status != 401:
                raise SystemExit(f"{name}: answered {status}, not 401")
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    setup()
    from capyctl.access.services import add_user, issue_api_key

    add_user("alice", staff=True)
    _, real = issue_api_key("alice", admin=True)
    for name, timings in asyncio.run(gateway_probes(args.rounds, real)).items():
        print(summary(name, timings))
    for name, timings in rest_probes(args.rounds, real).items():
        print(summary(name, timings))


if __name__ == "__main__":
    main()
