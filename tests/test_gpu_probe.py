"""The NVML probe, driven through a fake pynvml (the boundary: no GPU on test machines)."""

import os
from types import SimpleNamespace

import pynvml

from hostagent import probe as probe_module
from hostagent.agent import AgentFiles, probe_from_env
from hostagent.probe import CpuOnlyProbe, NvmlProbe, make_probe, open_nvml_probe
from hostagent.simgpu import write_allocation

GIB = 1024**3
MIB = 1024**2


class FakeNvml:
    """pynvml's functions over a list of fake devices, with its real error classes."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_DEVICE_ADDRESSING_MODE_ATS = pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS

    def __init__(self, devices):
        self.devices = devices

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def nvmlDeviceGetName(self, handle):
        return handle["name"].encode()

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        if handle.get("memory") == "unsupported":
            raise pynvml.NVMLError_NotSupported()
        total, used = handle["memory"]
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetAddressingMode(self, handle):
        if "addressing" not in handle:
            raise pynvml.NVMLError_NotSupported()
        return handle["addressing"]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle["procs"]]


def h100(procs=(), used=0):
    return {"name": "NVIDIA H100 80GB HBM3", "memory": (80 * GIB, used), "procs": list(procs)}


def test_several_gpus_with_totals_and_readings():
    fake = FakeNvml([h100(used=5 * GIB), h100(used=0)])
    nvml = NvmlProbe(fake)
    inventory = nvml.inventory()
    assert inventory.probe == "nvml"
    assert not inventory.unified
    assert [(g.index, g.name, g.total_bytes) for g in inventory.gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 80 * GIB),
        (1, "NVIDIA H100 80GB HBM3", 80 * GIB),
    ]
    readings = nvml.devices()
    assert readings[0].used_bytes == 5 * GIB
    assert readings[0].free_bytes == 75 * GIB
    assert readings[1].used_bytes == 0


def test_per_process_figures_sum_over_the_engine_process_tree(monkeypatch):
    # pid 100 is the engine, 101 its worker on gpu1; 200 belongs to someone else.
    fake = FakeNvml([h100(procs=[(100, 2 * GIB), (200, 7 * GIB)]), h100(procs=[(101, 30 * GIB)])])
    tree = [SimpleNamespace(pid=100), SimpleNamespace(pid=101)]
    monkeypatch.setattr(probe_module, "process_tree", lambda pid: tree if pid == 100 else [])
    monkeypatch.setattr(probe_module, "_tree_rss", lambda procs: 3 * GIB * len(procs))
    usage = NvmlProbe(fake).process_usage(100)
    assert usage.gpu == {0: 2 * GIB, 1: 30 * GIB}
    assert usage.gpu_total == 32 * GIB
    assert usage.host_bytes == 6 * GIB
    assert NvmlProbe(fake).gpu_processes()[200] == {0: 7 * GIB}


def test_unknown_per_process_values_stay_unknown(monkeypatch):
    fake = FakeNvml([h100(procs=[(100, None)])])
    monkeypatch.setattr(probe_module, "process_tree", lambda pid: [SimpleNamespace(pid=100)])
    monkeypatch.setattr(probe_module, "_tree_rss", lambda procs: 0)
    usage = NvmlProbe(fake).process_usage(100)
    assert usage.gpu == {0: None}
    assert usage.gpu_total is None
    assert not usage.gpu_known


def test_memory_not_supported_means_one_unified_pool(monkeypatch):
    monkeypatch.setattr(probe_module, "host_ram", lambda: (128 * GIB, 100 * GIB))
    fake = FakeNvml([{"name": "NVIDIA GB10", "memory": "unsupported", "procs": []}])
    nvml = NvmlProbe(fake)
    inventory = nvml.inventory()
    assert inventory.unified
    assert [(g.name, g.total_bytes) for g in inventory.gpus] == [("NVIDIA GB10", 128 * GIB)]
    (reading,) = nvml.devices()
    assert (reading.total_bytes, reading.used_bytes, reading.free_bytes) == (
        128 * GIB,
        28 * GIB,
        100 * GIB,
    )


def test_ats_addressing_means_unified(monkeypatch):
    monkeypatch.setattr(probe_module, "host_ram", lambda: (480 * GIB, 400 * GIB))
    device = h100() | {"addressing": pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS}
    assert NvmlProbe(FakeNvml([device])).inventory().unified


def test_no_nvml_library_is_a_cpu_only_host(monkeypatch, caplog):
    def missing():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    caplog.set_level("INFO", logger="hostagent.probe")
    assert open_nvml_probe() is None
    probe = make_probe(None)
    assert isinstance(probe, CpuOnlyProbe)
    assert probe.inventory().gpus == []
    assert probe.devices() == []
    assert "treating this host as CPU-only" in caplog.text


# A process that fills the first figure's MiB of its own memory (each page written, so
# resident), starts a copy of itself with the other figures, says "ready" once they all
# have, and holds on until its stdin closes.
_HOLDER = """
import subprocess, sys
held = b"x" * (int(sys.argv[1]) * 1024 * 1024)
child = None
if sys.argv[2:]:
    child = subprocess.Popen([sys.executable, *sys.argv[:1], *sys.argv[2:]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
print("ready", flush=True)
sys.stdin.read()
if child:
    child.stdin.close()
    child.wait()
"""


def test_cpu_only_process_usage_is_the_resident_memory_of_the_process_tree(tmp_path):
    import subprocess
    import sys

    import psutil

    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    sizes = (64, 96)  # MiB: the process, and its child
    holder = subprocess.Popen(
        [sys.executable, str(script), *map(str, sizes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "ready\n"
        tree = [psutil.Process(holder.pid), *psutil.Process(holder.pid).children(recursive=True)]
        assert len(tree) == 2
        usage = CpuOnlyProbe().process_usage(holder.pid)
        rss = sum(p.memory_info().rss for p in tree)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert usage.gpu == {}
    # Both processes count, each with what it filled (and the interpreter besides)...
    assert usage.host_bytes >= sum(sizes) * MIB
    # ...and the figure is their resident memory, as psutil reads it (idle processes:
    # their memory moves by a few pages between the two readings).
    assert abs(usage.host_bytes - rss) <= 4 * MIB


def test_each_host_agents_simulated_gpus_are_its_own(tmp_path, monkeypatch):
    """Two agents with simulated GPUs on one machine (a walk-through, a test run) do not
    see each other's engines: by default each keeps the simulation in its data dir."""
    monkeypatch.setenv("CAPYCTL_SIM_GPUS", "24GiB")
    monkeypatch.delenv("CAPYCTL_SIM_STATE_DIR", raising=False)
    # what a simulated engine of agent "a" records, as a live process (this one)
    write_allocation(tmp_path / "a" / "sim-gpus", os.getpid(), {0: 16 * GIB}, 0)
    assert probe_from_env(AgentFiles(tmp_path / "a")).devices()[0].used_bytes == 16 * GIB
    assert probe_from_env(AgentFiles(tmp_path / "b")).devices()[0].used_bytes == 0


def test_a_simulated_weights_copy_is_host_ram_in_use(tmp_path):
    """A simulated engine's weights copy in host RAM counted as the engine's RAM but never
    as RAM in use, so whatever the machine really used beside it looked smaller by the
    copy: a process CapyCTL did not start, holding a copy, hid its 8 GiB from the foreign
    figure. Host RAM as the simulation has it now includes the copies."""
    from hostagent.host import HostRuntime
    from hostagent.probe import SimulatedProbe
    from hostagent.simgpu import SimSpec

    state_dir = tmp_path / "sim"
    host = HostRuntime(SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB]), state_dir),
                       tmp_path / "logs")  # fmt: skip
    before = host.foreign(unified=False)["ram"]
    write_allocation(state_dir, os.getpid(), {0: 512 * 1024**2}, 8 * GIB)  # not its engine
    after = host.foreign(unified=False)["ram"]
    assert after - before > 7 * GIB, (before, after)
