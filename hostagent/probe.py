"""What a host has: its GPUs and its RAM.

Readings come from NVML (``nvidia-ml-py``) when the library is there, from a simulation
when ``CAPYCTL_SIM_GPUS`` asks for one, and RAM always from psutil. A host without NVML is
a CPU-only host; that is logged once, not treated as an error.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

logger = logging.getLogger("hostagent.probe")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Inventory:
    """A host's devices. ``unified``: GPU and RAM are one pool (GB10, integrated GPUs)."""

    probe: str
    ram_total_bytes: int
    unified: bool = False
    gpus: list[GpuInfo] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulated_inventory(kind: str, sizes: list[int]) -> Inventory:
    """The inventory ``CAPYCTL_SIM_GPUS`` describes (already parsed into kind and sizes)."""
    ram = psutil.virtual_memory().total
    if kind == "unified":
        return Inventory(
            probe="simulated",
            ram_total_bytes=sizes[0],
            unified=True,
            gpus=[GpuInfo(index=0, name="Simulated unified GPU", total_bytes=sizes[0])],
        )
    gpus = [
        GpuInfo(index=i, name=f"Simulated GPU {i}", total_bytes=size)
        for i, size in enumerate(sizes)
    ]
    return Inventory(probe="simulated", ram_total_bytes=ram, gpus=gpus)


def nvml_inventory() -> Inventory | None:
    """Read the GPUs through NVML, or return ``None`` when NVML is not available."""
    try:
        import pynvml
    except ImportError:
        logger.info("nvidia-ml-py is not installed: treating this host as CPU-only")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.info("NVML is not available (%s): treating this host as CPU-only", exc)
        return None
    try:
        gpus: list[GpuInfo] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(index=index, name=str(name), total_bytes=int(memory.total)))
    finally:
        pynvml.nvmlShutdown()
    return Inventory(probe="nvml", ram_total_bytes=psutil.virtual_memory().total, gpus=gpus)


def read_inventory(sim_gpus: tuple[str, list[int]] | None = None) -> Inventory:
    """This host's inventory: simulated when asked, else NVML, else CPU-only."""
    if sim_gpus is not None:
        return simulated_inventory(*sim_gpus)
    found = nvml_inventory()
    if found is not None:
        return found
    return Inventory(probe="none", ram_total_bytes=psutil.virtual_memory().total)
