"""What a running instance holds and says of itself, and the leases on its GPUs a step takes.

Its usage is the GPU probe's per-process figures, or, on the device path (where the probe
cannot see the engine's processes, :mod:`hostagent.measure`), what its steps measured.
Whether it is parked is asked of the engine on a client of its own. While a step measured
by device runs, a lease holds the instance's GPUs so that no other step moves their use.
"""

from __future__ import annotations

from hostagent.errors import EngineCallError
from hostagent.instances import Instance
from hostagent.kinds import EngineClient
from hostagent.measure import DeviceMeter, Lease
from hostagent.probe import DEVICE, ProcessUsage
from hostagent.units import format_size

ASK_SECONDS = 5.0  # how long a question to an engine about its state may take


def asleep(instance: Instance) -> bool | None:
    """Whether the engine says it is parked now, asked on a client of its own with a short
    timeout (never the one a park or wake is using); None where its kind cannot tell, it
    has ended, or it does not answer."""
    if not instance.process.alive():
        return None
    client = EngineClient(
        instance.port, instance.api_key, timeout=ASK_SECONDS, socket_path=instance.socket_path
    )
    try:
        return instance.kind.asleep(client, instance.spec)
    except EngineCallError:
        return None
    finally:
        client.close()


def usage(meter: DeviceMeter, instance: Instance) -> ProcessUsage:
    """What the instance's process tree holds now: the probe's figures, or on the device
    path what its steps measured (while its start is measured: what its GPUs grew by so
    far, so that it is never counted as someone else's)."""
    seen = meter.probe.process_usage(instance.pid)
    if instance.measured_by == DEVICE:
        return ProcessUsage(gpu=dict(instance.device_held), host_bytes=seen.host_bytes)
    before = instance.start_before
    if before is not None and not any(seen.gpu.get(i) for i in before):
        now = meter.used(list(before))
        grown = {i: max(now.get(i, 0) - used, 0) for i, used in before.items()}
        return ProcessUsage(gpu={**seen.gpu, **grown}, host_bytes=seen.host_bytes)
    return seen


def hold(meter: DeviceMeter, instance: Instance, step: str, seconds: float) -> Lease | None:
    """Hold the instance's GPUs for ``step``, where steps are measured by device."""
    gpus = meter.gpus(instance.request.gpu_indices)
    if not gpus or not meter.leases_steps():
        return None
    lease = meter.leases.acquire(f"the {step} of {instance.request.served_name}", gpus, seconds)
    instance.lease = lease
    return lease


def unlease(meter: DeviceMeter, instance: Instance, lease: Lease | None) -> None:
    """Let go of a step's GPUs (a stop may have ended its lease already)."""
    if lease is None:
        return
    meter.leases.release(lease)
    if instance.lease is lease:
        instance.lease = None


def describe_gpu(gpu: dict[int, int | None]) -> str:
    """What each GPU holds, for a message: ``gpu0 4.0 GiB, gpu1 unknown``."""
    parts = [
        f"gpu{index} {'unknown' if value is None else format_size(value)}"
        for index, value in sorted(gpu.items())
    ]
    return ", ".join(parts) or "no GPU memory"
