"""What a host has, and what each engine holds on it: the GPU probe.

Three probes share one interface:

- :class:`NvmlProbe` reads real GPUs through NVML (``nvidia-ml-py``): totals and use per
  device with memory info v2, and per-process use summed over an engine's process tree.
  A device whose memory calls answer NotSupported (GB10 and other integrated devices) or
  that addresses host memory through ATS makes the host *unified*: one pool sized from
  the host's MemTotal/MemAvailable.
- :class:`SimulatedProbe` reports the devices of ``CAPYCTL_SIM_GPUS`` and reads what the
  simulated engines record (:mod:`hostagent.simgpu`).
- :class:`CpuOnlyProbe` is a host without NVML: no GPUs, host RAM only, logged once.

Host RAM always comes from psutil. Per-process GPU figures can be unknown (NVML answers
``None`` without the right permissions, or inside some containers); they are then
``None``, and callers must treat unknown as "not confirmed released".

Where NVML cannot tie GPU memory to the engine's processes (a container without the
host's pids lists host pids, or none; ``None`` figures), the host runtime measures an
engine by its device's used memory before and after each of its steps instead
(:mod:`hostagent.measure`). Each probe says which way its listing allows, as far as one
reading shows (``measures``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from hostagent.simgpu import ProcessAllocation, SimSpec, default_state_dir, read_allocations
from hostagent.units import format_size

logger = logging.getLogger("hostagent.probe")

# How a host measures what each engine holds on its GPUs: by the probe's figures for the
# engine's own processes, or by the device's used memory before and after each step.
PER_PROCESS = "per process"
DEVICE = "device before/after"

# A GPU with this much in use while NVML lists no process on it is used by processes NVML
# does not show here (memory info v2 reports an idle device's use as a few MiB).
UNLISTED_USE_BYTES = 1024**3

# The simulated probe's ``foreign`` pids: past the kernel's largest pid (2**22), so that no
# process here has one, as with the host's pids seen from inside a container.
FOREIGN_PID_OFFSET = 1 << 22


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Inventory:
    """A host's devices. ``unified``: GPU and RAM are one pool (GB10, integrated GPUs).
    ``measures``: how engines' GPU memory is measured here (:data:`PER_PROCESS` or
    :data:`DEVICE`), and ``measures_reason`` why not per process (empty when it is)."""

    probe: str
    ram_total_bytes: int
    unified: bool = False
    gpus: list[GpuInfo] = field(default_factory=list)
    measures: str = PER_PROCESS
    measures_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Inventory:
        return cls(
            probe=str(data["probe"]),
            ram_total_bytes=int(data["ram_total_bytes"]),
            unified=bool(data.get("unified")),
            gpus=[GpuInfo(int(g["index"]), str(g["name"]), int(g["total_bytes"]))
                  for g in data.get("gpus") or []],
            measures=str(data.get("measures") or PER_PROCESS),
            measures_reason=str(data.get("measures_reason") or ""),
        )  # fmt: skip


@dataclass(frozen=True)
class DeviceReading:
    """One device now. On a unified host the single reading is the shared pool."""

    index: int
    total_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class ProcessUsage:
    """What one process tree holds: bytes per GPU index (``None`` = unknown) and host RAM."""

    gpu: dict[int, int | None]
    host_bytes: int

    @property
    def gpu_known(self) -> bool:
        return all(value is not None for value in self.gpu.values())

    @property
    def gpu_total(self) -> int | None:
        """Bytes on all GPUs together, or ``None`` when any reading is unknown."""
        if not self.gpu_known:
            return None
        return sum(value or 0 for value in self.gpu.values())


class Probe(Protocol):
    name: str

    def inventory(self) -> Inventory: ...

    def devices(self) -> list[DeviceReading]: ...

    def process_usage(self, pid: int) -> ProcessUsage:
        """GPU and RAM use of ``pid`` and all its descendants."""
        ...

    def gpu_processes(self) -> dict[int, dict[int, int | None]]:
        """Every process using a GPU: pid → bytes per GPU index (``None`` = unknown)."""
        ...

    def measures(self) -> tuple[str, str]:
        """(:data:`PER_PROCESS` or :data:`DEVICE`, why), as far as the processes listed now
        show; the host runtime learns the rest at its engines' starts."""
        ...

    def ram(self) -> tuple[int, int]:
        """(total, available) bytes of host RAM."""
        ...


def measures_seen(
    processes: dict[int, dict[int, int | None]],
    readings: list[DeviceReading],
    refused: dict[int, str] | None = None,
) -> tuple[str, str]:
    """How per-process figures can be used, judged from one listing of the GPUs' processes
    (``refused``: GPUs whose processes NVML would not list, with its error). A listing with
    no process and no use shows nothing: per process, until a start shows otherwise."""
    for pid, per_device in sorted(processes.items()):
        for index, used in sorted(per_device.items()):
            if used is None:
                return DEVICE, f"NVML gives no memory figure for pid {pid} on gpu{index}"
    for index, error in sorted((refused or {}).items()):
        return DEVICE, f"NVML does not list gpu{index}'s processes ({error})"
    if processes and not any(psutil.pid_exists(pid) for pid in processes):
        shown = ", ".join(str(pid) for pid in sorted(processes)[:3])
        return DEVICE, (
            f"NVML lists pids ({shown}) of which none is a process here: another pid "
            "namespace's (a container without the host's pids)"
        )
    listed = {index for per_device in processes.values() for index in per_device}
    for reading in readings:
        if reading.index not in listed and reading.used_bytes >= UNLISTED_USE_BYTES:
            return DEVICE, (
                f"gpu{reading.index} has {format_size(reading.used_bytes)} in use, and NVML "
                "lists no process on it"
            )
    return PER_PROCESS, ""


def tree_gpu(processes: dict[int, dict[int, int | None]], pids: set[int]) -> dict[int, int | None]:
    """Bytes per GPU index that the processes ``pids`` hold, from a listing of the GPUs'
    processes (``None``: some figure is unknown)."""
    gpu: dict[int, int | None] = {}
    for proc_pid, per_device in processes.items():
        if proc_pid not in pids:
            continue
        for index, used in per_device.items():
            if used is None or gpu.get(index, 0) is None:
                gpu[index] = None
            else:
                gpu[index] = (gpu.get(index) or 0) + used
    return gpu


# Finding descendants scans every process on the host (a few ms); an engine's workers
# rarely change, so a tree is reused for a short while once its root is known alive.
_TREE_TTL_SECONDS = 2.0
_trees: dict[int, tuple[float, list[psutil.Process]]] = {}
_trees_lock = threading.Lock()


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its live descendants (empty when ``pid`` is gone)."""
    now = time.monotonic()
    with _trees_lock:
        cached = _trees.get(pid)
    if cached is not None and now - cached[0] < _TREE_TTL_SECONDS:
        live = [proc for proc in cached[1] if proc.is_running()]
        if live and live[0].pid == pid:
            return live
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        with _trees_lock:
            _trees.pop(pid, None)
        return []
    with _trees_lock:
        _trees[pid] = (now, tree)
        for old in [p for p, (when, _) in _trees.items() if now - when > 60]:
            del _trees[old]
    return tree


def _tree_rss(tree: list[psutil.Process]) -> int:
    total = 0
    for proc in tree:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def host_ram() -> tuple[int, int]:
    """(total, available) bytes of host RAM, i.e. MemTotal and MemAvailable."""
    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


class CpuOnlyProbe:
    """A host without GPUs (or without the NVML library)."""

    name = "none"

    def inventory(self) -> Inventory:
        return Inventory(probe=self.name, ram_total_bytes=host_ram()[0])

    def devices(self) -> list[DeviceReading]:
        return []

    def process_usage(self, pid: int) -> ProcessUsage:
        return ProcessUsage(gpu={}, host_bytes=_tree_rss(process_tree(pid)))

    def gpu_processes(self) -> dict[int, dict[int, int | None]]:
        return {}

    def measures(self) -> tuple[str, str]:
        return PER_PROCESS, ""

    def ram(self) -> tuple[int, int]:
        return host_ram()


class SimulatedProbe:
    """Devices from ``CAPYCTL_SIM_GPUS``; use from what simulated engines record. Their
    processes are listed as ``spec.pids`` says (:data:`hostagent.simgpu.SIM_PIDS`): by
    their own pids, or as NVML lists them where it cannot see this pid namespace (on
    discrete GPUs: a unified pool is host memory, read per process)."""

    name = "simulated"

    def __init__(self, spec: SimSpec, state_dir: Path) -> None:
        self.spec = spec
        self.state_dir = state_dir

    def inventory(self) -> Inventory:
        if self.spec.unified:
            size = self.spec.sizes[0]
            return Inventory(
                probe=self.name,
                ram_total_bytes=size,
                unified=True,
                gpus=[GpuInfo(index=0, name="Simulated unified GPU", total_bytes=size)],
            )
        gpus = [
            GpuInfo(index=i, name=f"Simulated GPU {i}", total_bytes=size)
            for i, size in enumerate(self.spec.sizes)
        ]
        measures, reason = self.measures()
        return Inventory(probe=self.name, ram_total_bytes=host_ram()[0], gpus=gpus,
                         measures=measures, measures_reason=reason)  # fmt: skip

    def devices(self) -> list[DeviceReading]:
        used = [0] * len(self.spec.sizes)
        for allocation in read_allocations(self.state_dir):
            for index, num_bytes in allocation.gpu.items():
                if 0 <= index < len(used):
                    used[index] += num_bytes
            if self.spec.unified:
                used[0] += allocation.host_bytes
        return [
            DeviceReading(index=i, total_bytes=size, used_bytes=u, free_bytes=max(size - u, 0))
            for i, (size, u) in enumerate(zip(self.spec.sizes, used, strict=True))
        ]

    def process_usage(self, pid: int) -> ProcessUsage:
        tree = process_tree(pid)
        pids = {proc.pid for proc in tree}
        allocations = read_allocations(self.state_dir)
        # Host RAM is read by the process's own pid wherever it runs (psutil sees it).
        simulated_host = sum(a.host_bytes for a in allocations if a.pid in pids)
        gpu = tree_gpu(self._listing(allocations), pids)
        return ProcessUsage(gpu=gpu, host_bytes=_tree_rss(tree) + simulated_host)

    def gpu_processes(self) -> dict[int, dict[int, int | None]]:
        return self._listing(read_allocations(self.state_dir))

    def _listing(self, allocations: list[ProcessAllocation]) -> dict[int, dict[int, int | None]]:
        """The processes on the GPUs as this simulated NVML lists them (``spec.pids``)."""
        shown = "own" if self.spec.unified else self.spec.pids
        if shown == "empty":
            return {}
        offset = FOREIGN_PID_OFFSET if shown == "foreign" else 0
        return {
            allocation.pid + offset: {
                index: None if shown == "unknown" else num_bytes
                for index, num_bytes in allocation.gpu.items()
            }
            for allocation in allocations
            if allocation.gpu
        }

    def measures(self) -> tuple[str, str]:
        if self.spec.unified:
            return PER_PROCESS, ""
        return measures_seen(self.gpu_processes(), self.devices())

    def ram(self) -> tuple[int, int]:
        """Host RAM as the simulation has it: the real machine's, less the weights copies
        simulated engines say they keep there (on a discrete GPU; a unified device counts
        them as its own use). Without this, a parked copy would count as the engine's
        RAM but never as RAM in use, and what is left over would look foreign."""
        total, available = host_ram()
        if self.spec.unified:
            return total, available
        copies = sum(a.host_bytes for a in read_allocations(self.state_dir))
        return total, max(available - copies, 0)


class NvmlProbe:
    """Real GPUs through NVML. Construct with :func:`open_nvml_probe`."""

    name = "nvml"

    def __init__(self, pynvml: Any) -> None:
        self._nvml = pynvml
        self._lock = threading.Lock()  # NVML handles are shared; keep calls orderly
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._unified = any(self._is_unified(handle) for handle in self._handles)
        if self._unified:
            logger.info("GPU memory is shared with host RAM here: one 'unified' pool")

    def _memory(self, handle: Any) -> Any:
        nvml = self._nvml
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        except nvml.NVMLError_FunctionNotFound:
            return nvml.nvmlDeviceGetMemoryInfo(handle)

    def _is_unified(self, handle: Any) -> bool:
        nvml = self._nvml
        try:
            self._memory(handle)
        except nvml.NVMLError_NotSupported:
            return True
        try:
            mode = nvml.nvmlDeviceGetAddressingMode(handle)
        except (nvml.NVMLError, AttributeError):
            return False
        return bool(mode == nvml.NVML_DEVICE_ADDRESSING_MODE_ATS)

    def _name(self, handle: Any) -> str:
        name = self._nvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def inventory(self) -> Inventory:
        measures, reason = self.measures()
        with self._lock:
            ram_total = host_ram()[0]
            if self._unified:
                names = ", ".join(self._name(h) for h in self._handles) or "integrated GPU"
                return Inventory(
                    probe=self.name,
                    ram_total_bytes=ram_total,
                    unified=True,
                    gpus=[GpuInfo(index=0, name=names, total_bytes=ram_total)],
                )
            gpus = [
                GpuInfo(index=i, name=self._name(h), total_bytes=int(self._memory(h).total))
                for i, h in enumerate(self._handles)
            ]
            return Inventory(probe=self.name, ram_total_bytes=ram_total, gpus=gpus,
                             measures=measures, measures_reason=reason)  # fmt: skip

    def devices(self) -> list[DeviceReading]:
        with self._lock:
            if self._unified:
                total, available = host_ram()
                return [
                    DeviceReading(
                        index=0,
                        total_bytes=total,
                        used_bytes=total - available,
                        free_bytes=available,
                    )
                ]
            readings = []
            for index, handle in enumerate(self._handles):
                memory = self._memory(handle)
                readings.append(
                    DeviceReading(
                        index=index,
                        total_bytes=int(memory.total),
                        used_bytes=int(memory.used),
                        free_bytes=int(memory.free),
                    )
                )
            return readings

    def _mig_instances(self, handle: Any) -> list[Any]:
        """The MIG device handles of a GPU in MIG mode (empty otherwise)."""
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except (nvml.NVMLError, AttributeError):
            return []  # a GPU without MIG, or an NVML too old to know it
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return []
        found = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
            except nvml.NVMLError_NotFound:
                continue  # an empty slot
        return found

    def _device_processes(self, handle: Any) -> list[Any]:
        """The compute processes on a GPU. In MIG mode, those of each of its MIG instances
        with their per-instance figures: the GPU's own list is an aggregate that NVML gives
        only to the privileged (elsewhere it is empty, or has no figures)."""
        nvml = self._nvml
        instances = self._mig_instances(handle)
        if not instances:
            return list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        processes = []
        for instance in instances:
            processes.extend(nvml.nvmlDeviceGetComputeRunningProcesses(instance))
        return processes

    def _listing(self) -> tuple[dict[int, dict[int, int | None]], dict[int, str]]:
        """Every process on the GPUs (pid → bytes per GPU index), and the GPUs whose
        processes NVML would not list, with its error (no permission, in a container)."""
        nvml = self._nvml
        found: dict[int, dict[int, int | None]] = {}
        refused: dict[int, str] = {}
        with self._lock:
            for index, handle in enumerate(self._handles):
                try:
                    processes = self._device_processes(handle)
                except nvml.NVMLError_NotSupported:
                    continue
                except nvml.NVMLError as exc:
                    refused[index] = str(exc)
                    continue
                for proc in processes:
                    used = proc.usedGpuMemory
                    per_device = found.setdefault(int(proc.pid), {})
                    if used is None or per_device.get(index, 0) is None:
                        per_device[index] = None
                    else:
                        per_device[index] = (per_device.get(index) or 0) + int(used)
        return found, refused

    def gpu_processes(self) -> dict[int, dict[int, int | None]]:
        return self._listing()[0]

    def measures(self) -> tuple[str, str]:
        if self._unified:
            return PER_PROCESS, ""  # the pool is host memory: psutil reads it per process
        found, refused = self._listing()
        return measures_seen(found, self.devices(), refused)

    def ram(self) -> tuple[int, int]:
        return host_ram()

    def process_usage(self, pid: int) -> ProcessUsage:
        tree = process_tree(pid)
        gpu = tree_gpu(self.gpu_processes(), {proc.pid for proc in tree})
        host = _tree_rss(tree)
        if self._unified:
            # On unified memory GPU allocations are host memory: count them once, in the pool.
            gpu = {0: host}
        return ProcessUsage(gpu=gpu, host_bytes=host)


_said: set[str] = set()  # why this host counts as CPU-only, said once per process


def _say_cpu_only(why: str) -> None:
    """Log ``why`` the first time only: a start asks for a probe more than once, and the
    answer does not change."""
    if why not in _said:
        _said.add(why)
        logger.info("%s", why)


def open_nvml_probe() -> NvmlProbe | None:
    """An NVML probe, or ``None`` (logged once) when NVML or its library is missing."""
    try:
        import pynvml  # noqa: PLC0415 - optional: pynvml only where a GPU is
    except ImportError:
        _say_cpu_only("nvidia-ml-py is not installed: treating this host as CPU-only")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        _say_cpu_only(f"NVML is not available ({exc}): treating this host as CPU-only")
        return None
    return NvmlProbe(pynvml)


def make_probe(sim: SimSpec | None, sim_state_dir: Path | None = None) -> Probe:
    """The probe for this host: simulated when asked, else NVML, else CPU-only."""
    if sim is not None:
        return SimulatedProbe(sim, sim_state_dir or default_state_dir())
    nvml = open_nvml_probe()
    if nvml is not None:
        return nvml
    return CpuOnlyProbe()


def read_inventory(sim: SimSpec | None = None, sim_state_dir: Path | None = None) -> Inventory:
    """This host's inventory, from :func:`make_probe`."""
    return make_probe(sim, sim_state_dir).inventory()
