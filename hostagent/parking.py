"""Parking and waking a running instance, each confirmed rather than taken on its word.

A park is confirmed with the GPU probe's per-process figures before it counts as done, or,
where the probe cannot see the engine's processes, by its GPUs' used memory falling by its
share (:mod:`hostagent.measure`); what stays is its residual. A wake waits for health; on
the device path what its GPUs grew by is added to what it kept parked.
"""

from __future__ import annotations

import time

from hostagent.errors import MemoryNotReleasedError
from hostagent.instance_usage import describe_gpu, hold, unlease, usage
from hostagent.instances import Instance, call_engine, client_for
from hostagent.measure import (
    LEASE_MARGIN_SECONDS,
    RELEASED_SHARE,
    DeviceMeter,
    Lease,
    release_tolerance,
    released_on_device,
)
from hostagent.probe import DEVICE, ProcessUsage
from hostagent.process import wait_ready
from hostagent.units import format_size

# How long after a park the probe may take to show the memory freed (a vLLM sleep frees
# it before answering; NVML sees it at once): ``CAPYCTL_PARK_CONFIRM_SECONDS``.
DEFAULT_RELEASE_SECONDS = 10.0


def park(
    meter: DeviceMeter, instance: Instance, mode: str, timeout: float, *, release_timeout: float
) -> ProcessUsage:
    """Park in ``mode`` and confirm with the probe; return what is left (the residual).

    Raises :class:`~hostagent.errors.CannotParkError` when the kind cannot, and
    :class:`~hostagent.errors.MemoryNotReleasedError` when the engine says it parked
    but the probe does not show the memory released within ``release_timeout``.
    """
    seconds = timeout + release_timeout + LEASE_MARGIN_SECONDS
    lease = hold(meter, instance, f"{mode} park", seconds)
    try:
        if instance.measured_by == DEVICE:
            return _park_by_device(
                meter, instance, mode, timeout, release_timeout=release_timeout, lease=lease
            )
        return _park_per_process(meter, instance, mode, timeout, release_timeout=release_timeout)
    finally:
        unlease(meter, instance, lease)


def _park_per_process(
    meter: DeviceMeter, instance: Instance, mode: str, timeout: float, *, release_timeout: float
) -> ProcessUsage:
    before = usage(meter, instance)
    assigned = instance.request.gpu_indices or []
    if assigned and not all(before.gpu.get(i) is not None for i in assigned):
        # Without a reading for each of its GPUs, a release could never be confirmed.
        before = ProcessUsage(gpu={i: before.gpu.get(i) for i in assigned}, host_bytes=0)
    with client_for(instance, timeout) as client:
        call_engine(instance, lambda: instance.kind.park(client, instance.spec, mode))
    instance.parked_mode = mode
    deadline = time.monotonic() + release_timeout
    while True:
        now = usage(meter, instance)
        if _released(before, now):
            return now
        if time.monotonic() >= deadline:
            raise MemoryNotReleasedError(
                f"{instance.kind.name} engine for {instance.request.served_name} answered "
                f"the {mode} park, but the GPU probe still sees its memory "
                f"({describe_gpu(now.gpu)}; before: {describe_gpu(before.gpu)})",
                still_held=now.gpu,
            )
        time.sleep(0.05)


def _park_by_device(
    meter: DeviceMeter,
    instance: Instance,
    mode: str,
    timeout: float,
    *,
    release_timeout: float,
    lease: Lease | None,
) -> ProcessUsage:
    """A park confirmed by each of its GPUs' used memory falling by the instance's share
    there, less :func:`~hostagent.measure.release_tolerance`; what stays is its
    residual."""
    share = dict(instance.device_held)
    before = meter.used(list(share))
    with client_for(instance, timeout) as client:
        call_engine(instance, lambda: instance.kind.park(client, instance.spec, mode))
    instance.parked_mode = mode
    deadline = time.monotonic() + release_timeout
    while True:
        now = meter.used(list(share))
        fell = {i: before.get(i, 0) - now.get(i, 0) for i in share}
        intact = lease is not None and not lease.lost
        if intact and all(
            held is not None and released_on_device(held, fell[i]) for i, held in share.items()
        ):
            instance.device_held = {i: max((held or 0) - fell[i], 0) for i, held in share.items()}
            return usage(meter, instance)
        if time.monotonic() >= deadline:
            raise MemoryNotReleasedError(
                f"{instance.kind.name} engine for {instance.request.served_name} answered "
                f"the {mode} park, but its GPUs' used memory did not fall by its share "
                f"({_describe_fall(share, fell)})",
                still_held={
                    i: None if held is None else max(held - fell[i], 0) for i, held in share.items()
                },
            )
        time.sleep(0.05)


def wake(meter: DeviceMeter, instance: Instance, mode: str, timeout: float) -> float:
    """Wake from a ``mode`` park and wait until healthy; return the seconds it took. On
    the device path what its GPUs grew by is added to what it kept parked."""
    started = time.monotonic()
    lease = hold(meter, instance, f"{mode} wake", timeout + LEASE_MARGIN_SECONDS)
    try:
        before = meter.used(list(instance.device_held))
        with client_for(instance, timeout) as client:
            call_engine(instance, lambda: instance.kind.wake(client, instance.spec, mode))
        instance.parked_mode = None
        remaining = max(timeout - (time.monotonic() - started), 1.0)
        wait_ready(
            instance.process,
            lambda: instance.kind.is_healthy(instance.client, instance.spec),
            timeout=remaining,
            what=f"{instance.kind.name} engine for {instance.request.served_name}",
        )
        if instance.measured_by == DEVICE:
            after = meter.used(list(before))
            intact = lease is not None and not lease.lost
            instance.device_held = {
                i: None if held is None or not intact
                else held + max(after.get(i, 0) - before.get(i, 0), 0)
                for i, held in instance.device_held.items()
            }  # fmt: skip
    finally:
        unlease(meter, instance, lease)
    return time.monotonic() - started


def _released(before: ProcessUsage, now: ProcessUsage) -> bool:
    if not now.gpu_known or not before.gpu_known:
        return False  # unknown per-process figures can never confirm a release
    for index, held_before in before.gpu.items():
        held_now = now.gpu.get(index) or 0
        if held_before and held_now > held_before * RELEASED_SHARE:
            return False
    return True


def _describe_fall(share: dict[int, int | None], fell: dict[int, int]) -> str:
    parts = []
    for index, held in sorted(share.items()):
        if held is None:
            parts.append(f"gpu{index}: its share is unknown")
        else:
            needed = held - release_tolerance(held)
            parts.append(
                f"gpu{index} fell by {format_size(max(fell[index], 0))}, of its "
                f"{format_size(held)}: at least {format_size(needed)} needed"
            )
    return "; ".join(parts)
