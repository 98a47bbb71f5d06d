"""Real device memory behind a simulated engine: ``CAPYCTL_SIM_DEVICE=cuda``.

The engine still answers as the simulated one does, but what :class:`SimMemory` says it
holds is allocated for real on the process's CUDA devices with PyTorch, so the ledger, the
NVML probe's confirmations and the switch timings meet real bytes:

- loading allocates the weights (filled, so a copy moves real data) and the KV cache;
- a ``ram`` park (vLLM sleep level 1, SGLang with its CPU backup) copies the weights to
  pinned host memory, then frees both and returns the memory to the driver
  (``torch.cuda.empty_cache()``);
- a ``deep`` park (level 2) frees them without a copy;
- a wake allocates again and copies the weights back (or fills them, as a reload from
  disk would); ``CAPYCTL_SIM_KEEP_MEMORY=1`` keeps every allocation through a park.

The residual is the CUDA context the process already holds; nothing more is allocated for
it. PyTorch is never a dependency of CapyCTL: this module imports it only when asked.
Each copy is logged with its bytes, seconds and bandwidth (the engine's log).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Any

logger = logging.getLogger("hostagent.sim")

DEVICES = ("sim", "cuda")


class CudaUnavailable(SystemExit):
    """The engine cannot run on CUDA here; the message is its one line."""


def open_torch() -> Any:
    """PyTorch with at least one CUDA device, or :class:`CudaUnavailable` saying why."""
    try:
        torch = importlib.import_module("torch")  # optional: only a GPU-backed engine needs it
    except ImportError as exc:
        raise CudaUnavailable(
            f"hostagent.sim: CAPYCTL_SIM_DEVICE=cuda needs PyTorch with a CUDA device ({exc})"
        ) from None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise CudaUnavailable(
            "hostagent.sim: CAPYCTL_SIM_DEVICE=cuda needs a CUDA device, and PyTorch sees none"
        )
    return torch


class CudaBytes:
    """The engine's weights and KV cache as real allocations, one set per CUDA device the
    process sees (``cuda:0`` … in ``CUDA_VISIBLE_DEVICES`` order)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.count = int(torch.cuda.device_count())
        self.weights: dict[int, Any] = {}
        self.kv: dict[int, Any] = {}
        self.host: dict[int, Any] = {}

    def totals(self) -> list[int]:
        return [
            int(self.torch.cuda.get_device_properties(n).total_memory) for n in range(self.count)
        ]

    def _empty(self, num_bytes: int, ordinal: int) -> Any:
        return self.torch.empty(num_bytes, dtype=self.torch.uint8, device=f"cuda:{ordinal}")

    def _timed(self, what: str, num_bytes: int, move: Any) -> None:
        started = time.perf_counter()
        move()
        self.torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        rate = num_bytes / seconds / 1e9 if seconds > 0 else float("inf")
        logger.info("%s: %d bytes in %.3f s (%.1f GB/s)", what, num_bytes, seconds, rate)

    def apply(
        self,
        weights: dict[int, int],
        kv: dict[int, int],
        *,
        weights_on_gpu: bool,
        kv_on_gpu: bool,
        weights_in_ram: bool,
    ) -> None:
        """Make the real allocations what the simulated state says: ``weights`` and ``kv``
        map each device ordinal to its part's size."""
        freed = False
        for n, size in weights.items():
            if weights_on_gpu and n not in self.weights:
                tensor = self._empty(size, n)
                copy = self.host.pop(n, None)
                if copy is not None:
                    self._timed(f"cuda:{n} weights host -> device", size,
                                lambda t=tensor, c=copy: t.copy_(c, non_blocking=True))  # fmt: skip
                else:
                    self._timed(f"cuda:{n} weights filled", size, lambda t=tensor: t.fill_(1))
                self.weights[n] = tensor
            elif not weights_on_gpu and n in self.weights:
                tensor = self.weights.pop(n)
                if weights_in_ram:
                    copy = self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True)
                    self._timed(f"cuda:{n} weights device -> host", size,
                                lambda t=tensor, c=copy: c.copy_(t, non_blocking=True))  # fmt: skip
                    self.host[n] = copy
                del tensor
                freed = True
            if not weights_in_ram and n in self.host and not weights_on_gpu:
                del self.host[n]  # a deep park after a ram one: the copy is dropped too
        for n, size in kv.items():
            if kv_on_gpu and n not in self.kv and size > 0:
                self.kv[n] = self._empty(size, n)
            elif not kv_on_gpu and n in self.kv:
                del self.kv[n]
                freed = True
        if freed:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()  # back to the driver, where NVML sees it free

    def release_all(self) -> None:
        self.weights.clear()
        self.kv.clear()
        self.host.clear()


def check_device(value: str) -> str:
    """``CAPYCTL_SIM_DEVICE``'s value (empty: ``sim``), or exit with one line."""
    device = value or "sim"
    if device not in DEVICES:
        sys.exit(f"hostagent.sim: CAPYCTL_SIM_DEVICE must be sim or cuda, not {value!r}")
    return device
