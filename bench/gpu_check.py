"""What parking costs on a real GPU, and whether the ledger agrees with NVML.

Run through ``bench/gpu_check.sh`` on a machine with an NVIDIA GPU and PyTorch. It:

1. reads the GPU with CapyCTL's NVML probe and compares it with ``nvidia-smi`` and
   PyTorch's own figure;
2. measures the device's pinned host<->device copy bandwidth (the physical floor of a
   ``ram`` park and its wake);
3. runs CapyCTL standalone (in this process, SQLite, the real NVML probe) with two
   GPU-backed simulated vLLM models (``CAPYCTL_SIM_DEVICE=cuda``) that do not fit
   together, 40 % and 70 % of the device, with weights of 15 % of it;
4. switches between them (``--switches``, 20) and prints, per switch, the park and wake
   times, the bytes moved, the bandwidth against the floor, CapyCTL's own share of the
   switch, and whether the ledger agreed with NVML after it.

Each switch is asked for as the gateway asks (``ensure_ready``), then answered by the
engine; the ``/v1`` proxy's own cost is ``bench/proxy.py``'s. ``--sim`` runs steps 3-4 on
a simulated 80 GiB GPU instead (no bytes move: it checks the script, not the hardware).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

GIB = 1024**3


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not installed"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def smi_used_total() -> tuple[int, int]:
    out = subprocess.run(
        [shutil.which("nvidia-smi") or "nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
         "--id=0"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    used, total = (int(x.strip()) * 1024**2 for x in out.split(",")[:2])
    return used, total


def copy_floor() -> tuple[float, float]:
    """Pinned host->device and device->host GB/s, best of three 1 GiB copies each."""
    import torch

    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")
    rates = []
    for dst, src in ((device, host), (host, device)):
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, GIB / (time.perf_counter() - started) / 1e9)
        rates.append(best)
    del host, device
    torch.cuda.empty_cache()
    return rates[0], rates[1]


def setup(sim: bool) -> None:
    env = {
        "CAPYCTL_DATA_DIR": tempfile.mkdtemp(prefix="capyctl-gpu-check-"),
        "CAPYCTL_MIN_READY_SECONDS": "0",
        "CAPYCTL_MAX_TURN_SECONDS": "0",
        "CAPYCTL_LOG_LEVEL": "WARNING",
        "DJANGO_SETTINGS_MODULE": "capyctl.settings",
    }
    if sim:
        env["CAPYCTL_SIM_GPUS"] = "80GiB"
    os.environ.update(env)
    import django

    django.setup()
    from capyctl.bootstrap import prepare_standalone

    prepare_standalone()


def gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB"


def main() -> int:  # noqa: PLR0915 - one check, read top to bottom
    parser = argparse.ArgumentParser()
    parser.add_argument("--switches", type=int, default=20)
    parser.add_argument("--sim", action="store_true", help="a simulated GPU (checks the script)")
    args = parser.parse_args()
    if not args.sim:
        reason = no_gpu_reason()
        if reason is not None:
            print(f"gpu_check: no NVIDIA GPU to check here ({reason}); nothing was measured")
            return 0
    floor = (0.0, 0.0)
    if not args.sim:
        floor = copy_floor()
    setup(args.sim)
    import httpx

    from capyctl.deployments.services import DeploymentSpec, add_deployment
    from capyctl.engines.services import add_engine
    from capyctl.hosts.models import Host
    from capyctl.ledger.models import LedgerEntry
    from capyctl.scheduler import actions
    from capyctl.scheduler.drivers import local_driver
    from capyctl.scheduler.reconcile import reconcile

    driver = local_driver()
    (reading,) = driver.devices()[:1]
    print(f"probe: {driver.probe.name}, gpu0 {gb(reading.used_bytes)} used of "
          f"{gb(reading.total_bytes)}")  # fmt: skip
    if not args.sim:
        import torch

        smi_used, smi_total = smi_used_total()
        free, total = torch.cuda.mem_get_info(0)
        print(f"nvidia-smi: {gb(smi_used)} used of {gb(smi_total)}; PyTorch: "
              f"{gb(total - free)} used of {gb(total)}")  # fmt: skip
        print(f"copy floor (pinned, 1 GiB): host->device {floor[0]:.1f} GB/s, "
              f"device->host {floor[1]:.1f} GB/s")  # fmt: skip
    weights = int(reading.total_bytes * 0.15)
    env = {"CAPYCTL_SIM_WEIGHTS_BYTES": str(weights), "CAPYCTL_SIM_RESIDUAL_BYTES": "1MiB"}
    if not args.sim:
        env["CAPYCTL_SIM_DEVICE"] = "cuda"
    if os.environ.get("PYTHONPATH"):  # run from the working tree (gpu_check.sh): so is the engine
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    add_engine("gpu-sim", kind="vllm", command=f"{sys.executable} -m hostagent.sim vllm", env=env)
    models = [
        add_deployment(DeploymentSpec(name=name, engine="gpu-sim", source=f"m-{name}",
                                      gpu_memory_fraction=share, weights_bytes=weights))
        for name, share in (("a", 0.4), ("b", 0.7))
    ]  # fmt: skip
    host = Host.objects.get(name="local")
    calls: dict[str, float] = {}

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                calls[name] = calls.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    for name in ("park", "wake"):
        setattr(driver, name, timed(name, getattr(driver, name)))
    agreed = 0
    probe = "the probe" if args.sim else "NVML"
    try:
        actions.ensure_ready(models[0].pk)
        print(f"{args.switches} switches, weights {gb(weights)} a model "
              f"(a: 40 %, b: 70 % of the device)")  # fmt: skip
        for i in range(args.switches):
            target = models[(i + 1) % 2]
            calls.clear()
            started = time.perf_counter()
            ready = actions.ensure_ready(target.pk, timeout=600)
            instance = driver.instance(
                actions.instance_key(ready.instances.exclude(state="exited").get())
            )
            if instance is None:
                raise RuntimeError(f"{target.name} has no running engine")
            asked = time.perf_counter()
            # The engine listens on its Unix socket where its build can (docs/engines.md).
            path = instance.socket_path
            transport = httpx.HTTPTransport(uds=str(path)) if path is not None else None
            with httpx.Client(timeout=120, transport=transport) as engine:
                answer = engine.post(
                    f"{instance.base_url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {instance.api_key}"},
                    json={"model": target.name, "messages": [{"role": "user", "content": "hi"}]},
                )
            answer.raise_for_status()
            total = time.perf_counter() - started
            park, wake = calls.get("park", 0.0), calls.get("wake", 0.0)
            engine = park + wake + (time.perf_counter() - asked)
            reconcile(host.pk)  # foreign memory (this process's own context) read afresh
            counted = sum(LedgerEntry.objects.filter(host=host, pool="gpu0")
                          .values_list("bytes", flat=True))  # fmt: skip
            used = driver.devices()[0].used_bytes
            agree = abs(counted - used) <= max(GIB // 2, used // 50)
            agreed += agree
            rates = ""
            if park and wake and not args.sim:
                out, back = weights / park / 1e9, weights / wake / 1e9
                rates = (f"; park {out:.1f} GB/s ({out / floor[1]:.0%} of the floor), "
                         f"wake {back:.1f} GB/s ({back / floor[0]:.0%})")  # fmt: skip
            moved = "none (simulated)" if args.sim else gb(2 * weights if wake else weights)
            print(
                f"switch {i + 1:2} to {target.name}{' (its start)' if not wake else ''}: "
                f"{total:.2f} s; park {park:.2f} s, wake {wake:.2f} s, moved {moved}{rates}; "
                f"CapyCTL's share {(total - engine) * 1000:.0f} ms; ledger {gb(counted)} vs "
                f"{probe} {gb(used)}: {'agree' if agree else 'DIFFER'}"
            )
    finally:
        driver.stop_all(grace_seconds=5)
    print(f"ledger agreed with the probe after {agreed} of {args.switches} switches")
    return 0 if agreed == args.switches else 1


if __name__ == "__main__":
    sys.exit(main())
