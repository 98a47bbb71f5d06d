"""How long a switch takes, and how much of it is CapyCTL's own time.

Two simulated vLLM models of 16 GiB share a simulated 24 GiB GPU, with 0-second park and
wake. Each round asks for the parked one while the other holds the GPU, and measures the
time from the request to the first byte of the answer; the engine's own time (the park
and wake calls and the request itself) is timed separately, so the rest is CapyCTL's.

Run: .venv/bin/python bench/switch.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def setup() -> None:
    data = tempfile.mkdtemp(prefix="capyctl-bench-")
    os.environ.update(
        {
            "CAPYCTL_DATA_DIR": data,
            "CAPYCTL_SIM_GPUS": "24GiB",
            "CAPYCTL_MIN_READY_SECONDS": "0",
            "CAPYCTL_GPU_RESERVE": "0",
            "CAPYCTL_LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "capyctl.settings",
        }
    )
    import django

    django.setup()
    from capyctl.bootstrap import prepare_standalone

    prepare_standalone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    setup()
    import httpx

    from capyctl.deployments.services import DeploymentSpec, add_deployment
    from capyctl.engines.services import add_engine
    from capyctl.scheduler import operations
    from capyctl.scheduler.drivers import local_driver

    add_engine(
        "sim",
        kind="vllm",
        command=f"{sys.executable} -m hostagent.sim vllm",
        env={"CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB", "CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB"},
    )
    models = [
        add_deployment(
            DeploymentSpec(name=n, engine="sim", source=f"m-{n}", gpu_memory_bytes=16 * 1024**3)
        )
        for n in ("a", "b")
    ]
    driver = local_driver()
    engine_seconds = [0.0]

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                engine_seconds[0] += time.perf_counter() - started

        return wrapper

    for name in ("park", "wake"):
        setattr(driver, name, timed(getattr(driver, name)))

    try:
        for model in models:
            operations.ensure_ready(model.pk)
        totals, owns = [], []
        client = httpx.Client()
        for i in range(args.rounds):
            target = models[i % 2]  # the parked one
            engine_seconds[0] = 0.0
            started = time.perf_counter()
            ready = operations.ensure_ready(target.pk)
            instance = driver.instance(
                operations.instance_key(ready.instances.exclude(state="exited").get())
            )
            if instance is None:
                raise RuntimeError(f"{target.name} has no running engine")
            request_started = time.perf_counter()
            with client.stream(
                "POST",
                f"{instance.base_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {instance.api_key}"},
                json={
                    "model": target.name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                },
            ) as response:
                next(response.iter_raw())
            first_byte = time.perf_counter()
            engine = engine_seconds[0] + (first_byte - request_started)
            totals.append(first_byte - started)
            owns.append(first_byte - started - engine)
        total_ms = statistics.median(totals) * 1000
        own_ms = statistics.median(owns) * 1000
        print(f"switch to a parked model, {args.rounds} rounds (standalone, SQLite, simulated GPU)")
        p90_ms = sorted(totals)[int(len(totals) * 0.9) - 1] * 1000
        print(f"  request -> first byte: median {total_ms:.1f} ms, p90 {p90_ms:.1f} ms")
        print(f"  CapyCTL's own share:   median {own_ms:.1f} ms ({own_ms / total_ms:.0%} of it)")
        print(f"  target: median <= 50 ms -> {'met' if total_ms <= 50 else 'NOT met'}")
    finally:
        driver.stop_all(grace_seconds=2)


if __name__ == "__main__":
    main()
