"""The simulated engines' GPU-backed mode (``CAPYCTL_SIM_DEVICE=cuda``), on a machine
without a GPU: its refusals as a user meets them, and its moves of real allocations
driven through a fake PyTorch at the CUDA boundary. On a machine with a CUDA device the
last test runs on it for real."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from hostagent.runtime import free_port
from hostagent.sim.memory import SimMemory
from hostagent.sim.options import parse_options, read_knobs

GIB = 1024**3


def run_engine(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_SIM")}
    return subprocess.run(
        [sys.executable, "-m", "hostagent.sim", "vllm", "serve", "m", "--port",
         str(free_port()), "--enable-sleep-mode"],
        env={**env, **env_extra}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def torch_has_cuda() -> bool:
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(torch_has_cuda(), reason="this machine has CUDA: the engine would start")
def test_without_cuda_the_engine_says_so_in_one_line():
    done = run_engine({"CAPYCTL_SIM_DEVICE": "cuda"})
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hostagent.sim: CAPYCTL_SIM_DEVICE=cuda needs")


def test_an_unknown_device_is_refused_in_one_line():
    done = run_engine({"CAPYCTL_SIM_DEVICE": "tpu"})
    assert done.returncode != 0
    assert done.stderr.strip() == (
        "hostagent.sim: CAPYCTL_SIM_DEVICE must be sim or cuda, not 'tpu'"
    )


# --- the moves, through a fake PyTorch (the boundary: no CUDA device here) ----------------


@dataclass
class FakeTensor:
    nbytes: int
    device: str | None
    pinned: bool = False
    filled: bool = False
    source: FakeTensor | None = None

    def copy_(self, other: FakeTensor, non_blocking: bool = False) -> FakeTensor:
        assert other.nbytes == self.nbytes
        self.source, self.filled = other, other.filled
        return self

    def fill_(self, value: int) -> FakeTensor:
        self.filled = True
        return self


@dataclass
class FakeCuda:
    totals: list[int]
    emptied: int = 0
    synced: int = 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.totals)

    def get_device_properties(self, n: int) -> Any:
        return type("Props", (), {"total_memory": self.totals[n]})()

    def synchronize(self) -> None:
        self.synced += 1

    def empty_cache(self) -> None:
        self.emptied += 1


@dataclass
class FakeTorch:
    cuda: FakeCuda
    uint8: str = "uint8"
    made: list[FakeTensor] = field(default_factory=list)

    def empty(self, n: int, dtype: str, device: str | None = None, pin_memory: bool = False):
        tensor = FakeTensor(n, device, pin_memory)
        self.made.append(tensor)
        return tensor


@pytest.fixture
def memory(monkeypatch, tmp_path):
    fake = FakeTorch(FakeCuda([80 * GIB]))
    monkeypatch.setattr("hostagent.sim.memory.open_torch", lambda: fake)
    monkeypatch.setenv("CAPYCTL_SIM_STATE_DIR", str(tmp_path))
    options = parse_options(["vllm", "serve", "m", "--port", "1", "--enable-sleep-mode",
                             "--gpu-memory-utilization", "0.5"])  # fmt: skip
    knobs = replace(read_knobs(), device="cuda", weights_bytes=16 * GIB, residual_bytes=0)
    return SimMemory(options, knobs), fake


def held(bytes_of: dict[int, FakeTensor]) -> dict[int, int]:
    return {n: t.nbytes for n, t in bytes_of.items()}


def test_a_ram_park_copies_the_weights_to_pinned_memory_and_frees_the_device(memory):
    sim, fake = memory
    assert sim.claims == {0: 40 * GIB}  # half of the device PyTorch reports
    sim.load()
    assert held(sim.cuda.weights) == {0: 16 * GIB}
    assert held(sim.cuda.kv) == {0: 24 * GIB}
    assert sim.cuda.weights[0].filled
    assert sim.cuda.weights[0].device == "cuda:0"
    weights = sim.cuda.weights[0]

    sim.release(keep_weights_in_ram=True)  # vLLM sleep level 1
    assert sim.cuda.weights == {}
    assert sim.cuda.kv == {}
    copy = sim.cuda.host[0]
    assert (copy.nbytes, copy.pinned, copy.device, copy.source) == (16 * GIB, True, None, weights)
    assert fake.cuda.emptied == 1  # given back to the driver, where NVML sees it free

    sim.wake({"weights", "kv_cache"})
    assert sim.cuda.weights[0].source is copy  # copied back, not filled afresh
    assert held(sim.cuda.kv) == {0: 24 * GIB}
    assert sim.cuda.host == {}


def test_a_deep_park_drops_the_weights_and_a_wake_fills_them_again(memory):
    sim, _fake = memory
    sim.load()
    sim.release(keep_weights_in_ram=False)  # level 2
    assert sim.cuda.weights == {}
    assert sim.cuda.kv == {}
    assert sim.cuda.host == {}
    sim.wake({"weights"})
    assert sim.cuda.weights[0].source is None
    assert sim.cuda.weights[0].filled
    assert sim.cuda.kv == {}  # vLLM wakes the KV cache on its own call
    sim.wake({"kv_cache"})
    assert held(sim.cuda.kv) == {0: 24 * GIB}


def test_keep_memory_keeps_every_allocation_through_a_park(memory):
    sim, fake = memory
    sim.keep_memory = True
    sim.load()
    before = (sim.cuda.weights[0], sim.cuda.kv[0])
    sim.release(keep_weights_in_ram=True)
    assert (sim.cuda.weights[0], sim.cuda.kv[0]) == before
    assert sim.cuda.host == {}
    assert fake.cuda.emptied == 0


@pytest.mark.skipif(not torch_has_cuda(), reason="needs PyTorch with a CUDA device")
def test_on_a_real_device_a_ram_park_frees_what_nvml_sees(tmp_path, monkeypatch):
    import torch  # type: ignore[import-not-found,unused-ignore]

    monkeypatch.setenv("CAPYCTL_SIM_STATE_DIR", str(tmp_path))
    options = parse_options(["vllm", "serve", "m", "--port", "1", "--enable-sleep-mode",
                             "--gpu-memory-utilization", "0.2"])  # fmt: skip
    knobs = replace(read_knobs(), device="cuda", weights_bytes=2 * GIB, residual_bytes=0)
    sim = SimMemory(options, knobs)
    sim.load()
    used = torch.cuda.mem_get_info(0)
    sim.release(keep_weights_in_ram=True)
    after = torch.cuda.mem_get_info(0)
    assert after[0] - used[0] >= int(sim.claims[0] * 0.9)  # free memory grew by the claim
    sim.wake({"weights", "kv_cache"})
    assert torch.cuda.mem_get_info(0)[0] <= used[0] + GIB // 4  # and taken again
    sim.clear()


# --- bench/gpu_check.sh ------------------------------------------------------------------


@pytest.mark.skipif(torch_has_cuda(), reason="this machine has a GPU: the check would run")
def test_the_gpu_check_says_there_is_no_gpu_and_exits_0():
    done = subprocess.run(["bench/gpu_check.sh"], capture_output=True, text=True, timeout=120,
                          check=False, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_check: no NVIDIA GPU to check here (")
    assert done.stdout.strip().endswith("nothing was measured")


def test_the_gpu_checks_switching_runs_on_a_simulated_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--sim", "--switches", "3"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**env, "TMPDIR": str(tmp_path)},
        cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("switch ")] == [
        "switch  1 to b (its start)", "switch  2 to a", "switch  3 to b",
    ]  # fmt: skip
    assert lines[-1] == "ledger agreed with the probe after 3 of 3 switches"
