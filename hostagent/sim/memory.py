"""What a simulated engine holds on its simulated GPUs, recorded for the probe to read."""

from __future__ import annotations

import math
import os
from pathlib import Path

from hostagent.sim.cuda import CudaBytes, open_torch
from hostagent.sim.options import Knobs, SimOptions
from hostagent.simgpu import (
    SIM_GPUS_ENV,
    clear_allocation,
    parse_sim_gpus,
    read_allocations,
    state_dir_from_env,
    write_allocation,
)

DEFAULT_CLAIM_BYTES = 1024**3  # llama.cpp has no memory fraction flag
GIB = 1024**3
TF_LIMIT_VARIABLE = "TENSORFOLD_CUDA_MEMORY_LIMIT_GB"
TF_RESERVE_VARIABLE = "TENSORFOLD_MEMORY_RESERVE_GIB"


def tensorfold_reserve(total: int, value: str | None) -> int:
    """What TensorFold keeps free on a card (``cuda/capacity.py`` ``reserve_bytes``):
    max(4 GiB, a tenth of it), or TENSORFOLD_MEMORY_RESERVE_GIB from 2 to its size."""
    if value is None:
        return max(4 * GIB, total // 10)
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not 2 <= gib <= total / GIB:
        raise SystemExit(
            f"{TF_RESERVE_VARIABLE}={value}: a number of GiB from 2 to the memory's size"
        )
    return int(gib * GIB)


def tensorfold_limit(value: str | None) -> int | None:
    """TENSORFOLD_CUDA_MEMORY_LIMIT_GB in bytes (``cuda_limit_bytes``), refused as
    TensorFold refuses it."""
    if value is None:
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise SystemExit(f"{TF_LIMIT_VARIABLE} must be a positive number in GiB")
    return int(gib * GIB)


def tensorfold_budget(free: int, total: int, knobs: Knobs) -> int:
    """TensorFold's budget for weights and caches (``available_bytes``): the card's free
    memory less its reserve, under the cap where one is set."""
    granted = free - tensorfold_reserve(total, knobs.memory_reserve_gib)
    limit = tensorfold_limit(knobs.memory_limit_gb)
    return max(0, min(granted, limit)) if limit is not None else max(0, granted)


def lora_bytes(options: SimOptions, knobs: Knobs) -> int:
    """What an engine's adapters take on each GPU from its start: vLLM's and SGLang's
    slots (``CAPYCTL_SIM_LORA_SLOT_BYTES`` each, default 64 MiB), llama-server's --lora
    files (their size on disk)."""
    if options.kind == "llamacpp":
        files = [Path(p) for p in options.lora_files]
        return sum(f.stat().st_size for f in files if f.is_file())
    return options.lora_slots * knobs.lora_slot_bytes if options.lora else 0


def _others(state_dir: Path, pid: int) -> dict[int, int]:
    """What the other live processes hold on each simulated GPU."""
    held: dict[int, int] = {}
    for allocation in read_allocations(state_dir):
        if allocation.pid != pid:
            for index, num_bytes in allocation.gpu.items():
                held[index] = held.get(index, 0) + num_bytes
    return held


class SimMemory:
    """The engine's GPU memory in parts: residual (context), weights and KV cache.

    Parking moves the parts off the GPU (weights to host RAM for a ``ram`` park, or
    dropped); waking brings them back. Every change is written to the state dir.
    """

    def __init__(self, options: SimOptions, knobs: Knobs) -> None:
        self.pid = os.getpid()
        self.state_dir: Path = state_dir_from_env()
        self.keep_memory = knobs.keep_memory
        self.cuda: CudaBytes | None = None
        if knobs.device == "cuda":
            # Real devices: what the process sees is cuda:0 …, their sizes PyTorch's.
            self.cuda = CudaBytes(open_torch())
            self.devices: list[int] = list(range(self.cuda.count))
            totals = dict(enumerate(self.cuda.totals()))
            self.unified = False
        else:
            spec_text = os.environ.get(SIM_GPUS_ENV, "")
            spec = parse_sim_gpus(spec_text) if spec_text else None
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if spec is None:
                self.devices = []
            elif visible is None:
                self.devices = [0]
            else:
                self.devices = [int(i) for i in visible.split(",") if i.strip()]
            totals = {i: spec.sizes[i] for i in self.devices} if spec else {}
            self.unified = bool(spec and spec.unified)
        # SGLang and TensorFold size themselves from what the card has free.
        free = self._free(totals) if options.kind in ("sglang", "tensorfold") else {}
        claims = {}
        for index, total in totals.items():
            if knobs.gpu_bytes is not None:
                claims[index] = knobs.gpu_bytes
            elif options.kind == "sglang" and options.memory_fraction is not None:
                # Its static part: the fraction of the card less what others hold on it.
                used = total - free[index]
                claims[index] = max(int(total * options.memory_fraction) - used, 0)
            elif options.memory_fraction is not None:
                claims[index] = int(total * options.memory_fraction)
            elif options.kind == "tensorfold":
                claims[index] = knobs.residual_bytes + tensorfold_budget(free[index], total, knobs)
            else:
                claims[index] = min(DEFAULT_CLAIM_BYTES, total)
            if options.kind == "tensorfold" and knobs.gpu_bytes is not None:
                # What it would take, held to its budget (its CUDA context on top).
                budget = tensorfold_budget(free[index], total, knobs)
                claims[index] = min(claims[index], knobs.residual_bytes + budget)
        # LoRA: vLLM and SGLang allocate their adapter slots' buffers as they load the
        # model, inside their share (the KV cache gets less); llama-server loads its --lora
        # files at start on top of what it takes. Both are kept with the weights on a park.
        lora = lora_bytes(options, knobs)
        grows = options.kind == "llamacpp" and knobs.gpu_bytes is None
        self.claims = {i: min(c + lora * grows, totals[i]) for i, c in claims.items()}
        self.residual = {i: min(knobs.residual_bytes, c) for i, c in self.claims.items()}
        self.weights = {
            i: min(
                (knobs.weights_bytes if knobs.weights_bytes is not None else c // 2) + lora,
                self.claims[i] - self.residual[i],
            )
            for i, c in claims.items()
        }
        self.loaded = False
        self.weights_on_gpu = False
        self.kv_on_gpu = False
        self.weights_in_ram = False
        self.weights_valid = False

    def _free(self, totals: dict[int, int]) -> dict[int, int]:
        """Each device's free bytes before this engine takes any: on real devices what
        CUDA says, on simulated ones its size less what the other processes hold."""
        if self.cuda is not None:
            info = self.cuda.torch.cuda.mem_get_info
            return {i: int(info(i)[0]) for i in totals}
        others = _others(self.state_dir, self.pid)
        return {i: max(total - others.get(i, 0), 0) for i, total in totals.items()}

    # -- figures ---------------------------------------------------------------------------

    def gpu_bytes(self) -> dict[int, int]:
        if not self.loaded:
            return {}
        if self.keep_memory:
            return dict(self.claims)
        held = {}
        for index, claim in self.claims.items():
            kv = claim - self.weights[index] - self.residual[index]
            held[index] = (
                self.residual[index]
                + (self.weights[index] if self.weights_on_gpu else 0)
                + (kv if self.kv_on_gpu else 0)
            )
        return held

    def host_bytes(self) -> int:
        return sum(self.weights.values()) if self.weights_in_ram else 0

    def record(self) -> None:
        if self.cuda is None:
            write_allocation(self.state_dir, self.pid, self.gpu_bytes(), self.host_bytes())
            return
        keep = self.keep_memory and self.loaded  # a park that frees nothing
        self.cuda.apply(
            {i: self.weights[i] for i in self.devices},
            {i: self.claims[i] - self.weights[i] - self.residual[i] for i in self.devices},
            weights_on_gpu=self.loaded and (self.weights_on_gpu or keep),
            kv_on_gpu=self.loaded and (self.kv_on_gpu or keep),
            weights_in_ram=self.weights_in_ram and not keep,
        )

    def clear(self) -> None:
        if self.cuda is not None:
            self.cuda.release_all()
            return
        clear_allocation(self.state_dir, self.pid)

    # -- transitions ------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self.loaded and self.weights_on_gpu and self.kv_on_gpu and self.weights_valid

    @property
    def sleeping(self) -> bool:
        return self.loaded and not (self.weights_on_gpu and self.kv_on_gpu)

    def load(self) -> None:
        self.loaded = self.weights_on_gpu = self.kv_on_gpu = self.weights_valid = True
        self.record()

    def release(self, keep_weights_in_ram: bool) -> None:
        if self.weights_on_gpu:
            self.weights_in_ram = keep_weights_in_ram and self.weights_valid
            self.weights_valid = self.weights_in_ram
        self.weights_on_gpu = False
        self.kv_on_gpu = False
        self.record()

    def wake(self, tags: set[str]) -> None:
        if "weights" in tags and not self.weights_on_gpu:
            self.weights_on_gpu = True
            if self.weights_in_ram:
                self.weights_valid = True
                self.weights_in_ram = False
        if "kv_cache" in tags:
            self.kv_on_gpu = True
        self.record()

    def reload_weights(self) -> bool:
        if not self.weights_on_gpu:
            return False
        self.weights_valid = True
        self.record()
        return True
