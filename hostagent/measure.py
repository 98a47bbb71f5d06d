"""Measuring an engine by its GPUs' used memory when the probe cannot see its processes.

In a container without the host's pids (Docker without ``--pid=host``, Kubernetes,
gVisor), NVML lists the host's pids, or none, or no figures: none of them is the engine.
Then what an engine holds is what its devices' used memory grew by while it started (or
woke), and a park is confirmed by their used memory falling by about that share. Those
readings mean something only while nothing else changes on the same devices, so every
step that changes a GPU's memory (a start from launch to ready, a park, a wake, a stop)
takes that GPU's :class:`DeviceLeases` lease first, and holds it for the step.

:class:`DeviceMeter` keeps the host's verdict, learned at the first start that holds GPU
memory: ``per process`` once the probe shows an engine's own processes holding it (no
lease is taken from then on), ``device before/after`` once a start grows its GPUs' used
memory while the probe shows none of it as the engine's, or shows no figure at all.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from hostagent.probe import DEVICE, PER_PROCESS, Probe, ProcessUsage
from hostagent.units import format_size

logger = logging.getLogger("hostagent.measure")

# A park counts as released on the per-process path when each GPU's figure fell to at most
# this share of what it was: engines keep a residual (CUDA context, graphs) that is small
# next to their claim.
RELEASED_SHARE = 0.5

# On the device path a park is confirmed when each GPU's used memory fell by at least the
# engine's share there less a tolerance: 5% of the share, but at least 1 GiB (what a
# sleeping engine keeps: its CUDA context and graphs, 0.5 to 1.5 GiB for vLLM), and never
# more than half the share (the per-process rule's bound), so a park that frees nothing is
# never confirmed. What stays is measured as the engine's residual.
DEVICE_RELEASE_TOLERANCE_SHARE = 0.05
DEVICE_RELEASE_TOLERANCE_MIN_BYTES = 1024**3

# A start that grows a GPU's used memory by less than this holds nothing there (a CUDA
# context alone is several hundred MiB).
VISIBLE_GROWTH_BYTES = 64 * 1024**2

# How long a launch holds its GPUs before its wait for readiness renews the lease for that
# wait's own timeout; any lease is held at most for its step's timeout and this margin,
# past which the next step takes the GPU over (a caller that died mid-step).
LAUNCH_LEASE_SECONDS = 120.0
LEASE_MARGIN_SECONDS = 30.0


def release_tolerance(share: int) -> int:
    """Bytes of an engine's ``share`` on a GPU that a confirmed park may leave held there."""
    tolerance = max(int(share * DEVICE_RELEASE_TOLERANCE_SHARE), DEVICE_RELEASE_TOLERANCE_MIN_BYTES)
    return min(tolerance, int(share * RELEASED_SHARE))


def released_on_device(share: int, fell: int) -> bool:
    """Whether a GPU's used memory falling by ``fell`` confirms the park of an engine whose
    share there is ``share``."""
    return fell >= share - release_tolerance(share)


@dataclass(eq=False)
class Lease:
    """GPUs held for one step. ``lost``: it was taken over past its bound, or ended by a
    stop of its engine, so readings taken under it may include others' changes."""

    holder: str
    indices: tuple[int, ...]
    until: float
    lost: bool = False
    start: bool = False  # a start's (its engine's growth is counted as its own meanwhile)


@dataclass
class DeviceLeases:
    """At most one measured step at a time on each GPU."""

    _held: dict[int, Lease] = field(default_factory=dict)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def acquire(
        self, holder: str, indices: list[int], seconds: float, *, start: bool = False
    ) -> Lease:
        """Wait until no live lease holds any of ``indices``, then hold them all for at most
        ``seconds``. A lease past its bound is taken over (and marked lost)."""
        wanted = tuple(sorted(set(indices)))
        logged = False
        with self._changed:
            while True:
                now = time.monotonic()
                busy = {self._held[i] for i in wanted if i in self._held}
                live = [lease for lease in busy if lease.until > now]
                if not live:
                    break
                if not logged:
                    logger.info("%s waits for gpu%s: %s is measured there", holder,
                                ",".join(map(str, wanted)), live[0].holder)  # fmt: skip
                    logged = True
                self._changed.wait(timeout=min(lease.until for lease in live) - now)
            for lease in busy:
                logger.warning("%s takes gpu%s over from %s, past its bound", holder,
                               ",".join(map(str, lease.indices)), lease.holder)  # fmt: skip
                lease.lost = True
                self._drop(lease)
            taken = Lease(holder, wanted, now + seconds, start=start)
            for index in wanted:
                self._held[index] = taken
            return taken

    def renew(self, lease: Lease, seconds: float) -> None:
        with self._changed:
            if not lease.lost:
                lease.until = time.monotonic() + seconds

    def release(self, lease: Lease) -> None:
        with self._changed:
            self._drop(lease)

    def end(self, lease: Lease) -> None:
        """Release a lease whose step is being cut short (its engine is stopped)."""
        with self._changed:
            lease.lost = True
            self._drop(lease)

    def busy(self) -> set[int]:
        """The GPUs a measured park, wake or stop holds now (their use is moving: whose it
        is, the step says when it ends). A start's are not: what its GPUs grew by since
        its launch is counted as its engine's meanwhile."""
        now = time.monotonic()
        with self._changed:
            return {
                index
                for index, lease in self._held.items()
                if lease.until > now and not lease.start
            }

    def _drop(self, lease: Lease) -> None:
        for index in lease.indices:
            if self._held.get(index) is lease:
                del self._held[index]
        self._changed.notify_all()


class DeviceMeter:
    """How this host measures its engines' GPU memory, and the leases that keep measured
    steps from overlapping on a GPU."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.leases = DeviceLeases()
        self._verdict: tuple[str, str] | None = None
        self._gpu_indices: list[int] | None = None  # discrete GPUs; [] where none or unified
        self._lock = threading.Lock()

    def gpu_indices(self) -> list[int]:
        if self._gpu_indices is None:
            inventory = self.probe.inventory()
            self._gpu_indices = [] if inventory.unified else [g.index for g in inventory.gpus]
        return self._gpu_indices

    def gpus(self, assigned: list[int] | None) -> list[int]:
        """The discrete GPUs a step of an engine given ``assigned`` changes (``None``: all
        it can see). Empty on a unified or CPU-only host: nothing is measured by device."""
        known = self.gpu_indices()
        return sorted(set(known if assigned is None else assigned) & set(known))

    def learned(self) -> tuple[str, str] | None:
        """(way, why) learned from this host's engines, or ``None`` before any showed it."""
        return self._verdict

    def measures(self) -> tuple[str, str]:
        """(way, why): what the engines showed, else what the probe's listing shows now."""
        return self._verdict or self.probe.measures()

    def leases_starts(self) -> bool:
        """Whether a start must hold its GPUs: until the probe showed an engine's own
        processes, its reading before and after may be the one that counts."""
        return self._verdict is None or self._verdict[0] == DEVICE

    def leases_steps(self) -> bool:
        """Whether parks, wakes and stops must hold their GPUs: on the device path."""
        return self._verdict is not None and self._verdict[0] == DEVICE

    def used(self, gpus: list[int]) -> dict[int, int]:
        """Each of ``gpus``' used bytes now."""
        wanted = set(gpus)
        return {r.index: r.used_bytes for r in self.probe.devices() if r.index in wanted}

    def adopt(self, measured_by: str | None) -> None:
        """An engine of an earlier run, measured ``measured_by``, is back: its way stands."""
        if measured_by == DEVICE:
            self._decide(DEVICE, "an engine of an earlier run was measured by its device")
        elif measured_by == PER_PROCESS:
            self._decide(PER_PROCESS, "")

    def judge_start(self, usage: ProcessUsage, grew: dict[int, int], what: str) -> str | None:
        """How a just-started engine is measured: :data:`PER_PROCESS` when the probe shows
        its processes holding what its GPUs grew by, :data:`DEVICE` when it shows none of
        it as theirs, or no figure; ``None`` when it holds nothing on a GPU (no verdict).
        ``grew``: each GPU's growth in used memory over the start; ``what``: the engine."""
        unknown = [i for i in sorted(grew) if i in usage.gpu and usage.gpu[i] is None]
        unseen = [
            i for i in sorted(grew) if not usage.gpu.get(i) and grew[i] >= VISIBLE_GROWTH_BYTES
        ]
        if unknown:
            gpus = ", ".join(f"gpu{i}" for i in unknown)
            reason = f"the GPU probe gives no memory figure for {what}'s processes on {gpus}"
        elif unseen:
            grown = ", ".join(f"gpu{i} by {format_size(grew[i])}" for i in unseen)
            reason = (
                f"the GPU probe lists no process of {what} while its start grew the used "
                f"memory of {grown} (a container without the host's pids?)"
            )
        elif any(usage.gpu.get(i) for i in grew):
            self._decide(PER_PROCESS, "")
            return PER_PROCESS
        else:
            return None
        self._decide(DEVICE, reason)
        return DEVICE

    def _decide(self, way: str, reason: str) -> None:
        with self._lock:
            if self._verdict is not None and (self._verdict[0] == DEVICE or way == PER_PROCESS):
                return  # the device path, once found needed, stays: it is never wrong
            self._verdict = (way, reason)
        if way == DEVICE:
            logger.warning(
                "GPU memory is measured by each device's use before and after every start, "
                "park and wake here, one at a time per GPU: %s",
                reason,
            )
