"""The NVML probe, driven through a fake pynvml (the boundary: no GPU on test machines)."""

import os
import shlex
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pynvml
import pytest

from hostagent import probe as probe_module
from hostagent import process as process_module
from hostagent.agent import AgentError, AgentFiles, probe_from_env
from hostagent.errors import MemoryNotReleasedError
from hostagent.host import HostRuntime
from hostagent.measure import DeviceLeases, Lease, release_tolerance, released_on_device
from hostagent.probe import CpuOnlyProbe, NvmlProbe, ProcessUsage, make_probe, open_nvml_probe
from hostagent.runtime import InstanceRequest
from hostagent.simgpu import read_allocations, write_allocation

GIB = 1024**3
MIB = 1024**2


class FakeNvml:
    """pynvml's functions over a list of fake devices, with its real error classes.

    A device is a dict: ``name``, ``memory`` (total, used) or ``"unsupported"``, ``procs``
    [(pid, usedGpuMemory)] (``None``: NVML_VALUE_NOT_AVAILABLE, as pynvml gives it), or
    ``procs_error`` (an NVML error class the listing raises); ``addressing``; ``mig``: its
    MIG instances, each a dict with ``memory`` and ``procs``."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_DEVICE_ADDRESSING_MODE_ATS = pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    MIG_SLOTS = 7  # an A100's or H100's

    def __init__(self, devices):
        self.devices = devices

    def nvmlDeviceGetMigMode(self, handle):
        if "mig" not in handle:
            raise pynvml.NVMLError_NotSupported()
        return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return self.MIG_SLOTS

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        instances = handle["mig"]
        if index >= len(instances):
            raise pynvml.NVMLError_NotFound()
        return instances[index]

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
        if "procs_error" in handle:
            raise handle["procs_error"]()
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
    monkeypatch.setattr(probe_module, "_said", set())  # said once a process: not yet here
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


# --- when NVML cannot tie memory to the engine's pids (containers, MIG) ------------------
#
# Five things NVML may list for an engine's GPU: its own pids (a bare host, or a container
# with the host's pids); pids of another pid namespace (Docker without --pid=host,
# Kubernetes, gVisor: the host's pids, none of them a process here); nothing at all; its
# processes with no figure (usedGpuMemory NVML_VALUE_NOT_AVAILABLE, which pynvml gives as
# None); and, on a GPU in MIG mode, an empty aggregate list with the processes and their
# figures on each MIG instance. Foreign pids are drawn past the kernel's largest (2**22).

HOST_PID = 1 << 22  # a pid no process here has
SIM = f"{sys.executable} -m hostagent.sim"
MEMORY = {  # a simulated vLLM's: its claim, its weights, what it keeps parked
    "CAPYCTL_SIM_GPU_BYTES": "16GiB",
    "CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB",
    "CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB",
}


def test_the_probe_says_how_its_listing_lets_engines_be_measured():
    own = os.getpid()
    cases = {
        "matching": h100(procs=[(own, 2 * GIB)], used=2 * GIB),
        "foreign": h100(procs=[(HOST_PID + 7, 2 * GIB)], used=2 * GIB),
        "empty": h100(procs=[], used=14 * GIB),
        "unknown": h100(procs=[(own, None)], used=2 * GIB),
        "mig": mig_h100([[(own, 2 * GIB)], []]),
        "mig unknown": mig_h100([[(own, None)], []]),
        "refused": h100(used=2 * GIB) | {"procs_error": pynvml.NVMLError_NoPermission},
    }
    seen = {case: NvmlProbe(FakeNvml([device])).inventory() for case, device in cases.items()}
    assert {case: inventory.measures for case, inventory in seen.items()} == {
        "matching": "per process",
        "foreign": "device before/after",
        "empty": "device before/after",
        "unknown": "device before/after",
        "mig": "per process",
        "mig unknown": "device before/after",
        "refused": "device before/after",
    }
    assert "another pid namespace's" in seen["foreign"].measures_reason
    assert (
        seen["empty"].measures_reason == "gpu0 has 14.0 GiB in use, and NVML lists no process on it"
    )
    assert seen["unknown"].measures_reason == f"NVML gives no memory figure for pid {own} on gpu0"
    assert seen["refused"].measures_reason.startswith("NVML does not list gpu0's processes (")
    # An idle GPU with nothing listed shows nothing either way: per process, until a start
    # shows otherwise (the host runtime learns it).
    assert NvmlProbe(FakeNvml([h100(used=5 * MIB)])).inventory().measures == "per process"


def test_a_listing_nvml_refuses_is_no_process_rather_than_a_crash():
    fake = FakeNvml([h100(used=2 * GIB) | {"procs_error": pynvml.NVMLError_NoPermission}])
    assert NvmlProbe(fake).gpu_processes() == {}  # the old probe raised NVMLError here


def mig_h100(instances, parent_procs=()):
    """An H100 in MIG mode: NVML's memory info of the GPU is the whole GPU's, its own
    process list is an aggregate only the privileged get (empty here); each MIG instance
    lists its processes with their figures."""
    used = sum(u or 0 for instance in instances for _, u in instance)
    mig = [{"memory": (40 * GIB, sum(u or 0 for _, u in instance)), "procs": list(instance)}
           for instance in instances]  # fmt: skip
    return h100(procs=parent_procs, used=used) | {"mig": mig}


def test_on_a_mig_gpu_processes_are_read_from_its_instances(monkeypatch):
    # pid 100 (the engine) on the first instance; someone else's 200 on the second.
    fake = FakeNvml([mig_h100([[(100, 12 * GIB)], [(200, 7 * GIB)]]), h100()])
    monkeypatch.setattr(probe_module, "process_tree", lambda pid: [SimpleNamespace(pid=pid)])
    monkeypatch.setattr(probe_module, "_tree_rss", lambda procs: 0)
    nvml = NvmlProbe(fake)
    assert nvml.process_usage(100).gpu == {0: 12 * GIB}  # the old probe: {}
    assert nvml.gpu_processes() == {100: {0: 12 * GIB}, 200: {0: 7 * GIB}}
    assert nvml.devices()[0].used_bytes == 19 * GIB  # the pool is the whole GPU
    assert not nvml.inventory().unified


class LiveDevice(dict[str, Any]):
    """A fake device read afresh at each NVML call (``read`` builds its dict)."""

    def __init__(self, read):
        super().__init__()
        self._read = read

    def __getitem__(self, key):
        return self._read()[key]

    def __contains__(self, key):
        return key in self._read()

    def get(self, key, default=None):
        return self._read().get(key, default)


def sim_backed_h100(state_dir, case):
    """An 80 GiB H100 whose use is what simulated engines record in ``state_dir``, its
    processes listed as NVML lists them in ``case``."""

    def read():
        allocations = [a for a in read_allocations(state_dir) if a.gpu.get(0)]
        used = sum(a.gpu[0] for a in allocations)
        pid_offset = HOST_PID if case == "foreign" else 0
        listed = [(a.pid + pid_offset, None if case == "unknown" else a.gpu[0])
                  for a in allocations]  # fmt: skip
        if case == "empty":
            listed = []
        if case != "mig":
            return h100(procs=listed, used=used)
        others = [(a.pid, a.gpu[0]) for a in allocations if a.pid == os.getpid()]
        engines = [(a.pid, a.gpu[0]) for a in allocations if a.pid != os.getpid()]
        return mig_h100([engines, others])

    return LiveDevice(read)


def nvml_host(tmp_path, case):
    """A host runtime on an NVML probe over one simulated GPU, on which this test process
    holds 2 GiB (someone else's process), and the launch of a simulated vLLM on it."""
    state_dir = tmp_path / "sim"
    write_allocation(state_dir, os.getpid(), {0: 2 * GIB}, 0)
    probe = NvmlProbe(FakeNvml([sim_backed_h100(state_dir, case)]))
    host = HostRuntime(probe, tmp_path / "logs", tmp_path / "instances.json", release_timeout=2.0)

    def launch(name, **env):
        memory = {**MEMORY, "CAPYCTL_SIM_GPUS": "80GiB", "CAPYCTL_SIM_STATE_DIR": str(state_dir)}
        host.launch(InstanceRequest(
            instance_id=name, kind="vllm", command=f"{SIM} vllm", source=f"/models/{name}",
            served_name=name, gpu_indices=[0], env={**memory, **env},
        ))  # fmt: skip

    return host, launch


@pytest.fixture
def engines():
    hosts: list[HostRuntime] = []
    yield hosts
    for host in hosts:
        host.stop_all(grace_seconds=2)


@pytest.mark.parametrize(
    ("case", "measures"),
    [
        ("matching", "per process"),
        ("foreign", "device before/after"),
        ("empty", "device before/after"),
        ("unknown", "device before/after"),
        ("mig", "per process"),
    ],
)
def test_a_start_records_the_engines_share_and_its_park_is_confirmed(
    tmp_path, engines, case, measures
):
    """Whatever NVML shows of the engine's pids, a start measures the 16 GiB it holds
    and a park is confirmed, leaving its 512 MiB residual. The old probe found none of it
    outside the first case: the start kept its claim as a guess, and every park was "not
    released", so its model was stopped and its engine marked as keeping its memory."""
    host, launch = nvml_host(tmp_path, case)
    engines.append(host)
    launch("a")
    host.wait_ready("a", 60)
    assert host.usage("a").gpu == {0: 16 * GIB}
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB  # only the other process
    assert host.park("a", "ram", 60).gpu == {0: 512 * MIB}
    assert host.usage("a").gpu == {0: 512 * MIB}
    host.wake("a", "ram", 60)
    assert host.usage("a").gpu == {0: 16 * GIB}
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB
    assert host.inventory().measures == measures  # what the host reports, and why
    assert bool(host.inventory().measures_reason) == (measures == "device before/after")


@pytest.mark.parametrize("case", ["foreign", "unknown"])
def test_a_park_that_frees_nothing_is_not_confirmed_by_device(tmp_path, engines, case):
    host, launch = nvml_host(tmp_path, case)
    engines.append(host)
    launch("a", CAPYCTL_SIM_KEEP_MEMORY="1")
    host.wait_ready("a", 60)
    with pytest.raises(MemoryNotReleasedError) as refused:
        host.park("a", "ram", 60)
    assert str(refused.value).endswith(
        "answered the ram park, but its GPUs' used memory did not fall by its share "
        "(gpu0 fell by 0 B, of its 16.0 GiB: at least 15.0 GiB needed)"
    )
    assert refused.value.still_held == {0: 16 * GIB}
    assert host.usage("a").gpu == {0: 16 * GIB}  # still counted as held


def test_on_the_device_path_one_step_at_a_time_changes_a_gpu(tmp_path, engines):
    """A park of a waits while b's start is measured on the same GPU: else b's share would
    be its 8 GiB less the 15.5 GiB a gave back meanwhile."""
    host, launch = nvml_host(tmp_path, "foreign")
    engines.append(host)
    launch("a")
    host.wait_ready("a", 60)
    gate = tmp_path / "b-loads"
    launch("b", CAPYCTL_SIM_GPU_BYTES="8GiB", CAPYCTL_SIM_LOAD_GATE=str(gate))
    starting = threading.Thread(target=host.wait_ready, args=("b", 60))
    starting.start()
    parked: dict[str, ProcessUsage] = {}
    parking = threading.Thread(target=lambda: parked.update(a=host.park("a", "ram", 60)))
    deadline = time.monotonic() + 30
    while not gate.with_name("b-loads.waiting").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    parking.start()
    time.sleep(0.5)
    assert parking.is_alive()  # waits for the GPU
    assert host.usage("a").gpu == {0: 16 * GIB}
    gate.touch()
    starting.join(60)
    parking.join(60)
    assert host.usage("b").gpu == {0: 8 * GIB}
    assert parked["a"].gpu == {0: 512 * MIB}
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB


def test_an_engine_that_grows_or_ends_while_foreign_memory_is_read_is_not_foreign(
    tmp_path, engines, monkeypatch
):
    """Foreign memory is the GPU's use less what the host's engines hold, read one after
    the other: an engine woken between the two reads, or one that had not yet exited
    after its stop was asked, was counted as someone else's. A reconcile pass then held up
    to 7.5 GiB of that as foreign until the next pass, and the scheduler stopped a model
    it would have parked (a failure of the what-if agreement test on a busy machine)."""
    host, launch = nvml_host(tmp_path, "matching")
    engines.append(host)
    launch("a")
    host.wait_ready("a", 60)
    host.park("a", "ram", 60)
    read_devices = host.devices

    def woken_meanwhile():
        host.wake("a", "ram", 60)
        return read_devices()

    monkeypatch.setattr(host, "devices", woken_meanwhile)
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB  # only the other process
    monkeypatch.setattr(host, "devices", read_devices)

    # A stop whose engine takes its time to exit: its memory is still its own.
    exiting, go = threading.Event(), threading.Event()
    slow_exit = process_module.stop_process

    def stop_process(process, grace_seconds):
        exiting.set()
        go.wait(30)
        return slow_exit(process, grace_seconds=grace_seconds)

    monkeypatch.setattr("hostagent.runtime.stop_process", stop_process)
    stopping = threading.Thread(target=host.stop, args=("a", 10))
    stopping.start()
    try:
        assert exiting.wait(30)
        assert host.foreign(unified=False)["gpu0"] == 2 * GIB
    finally:
        go.set()
        stopping.join(30)
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB  # gone, and not counted


# An engine whose worker holds the GPU memory and outlives its leader's exit by its own
# time, as vLLM's engine core can (here: in a session of its own, so the group's signals
# miss it and the stop waits out its grace for it).
_LEADER = (
    "import subprocess, sys; "
    "sys.exit(subprocess.Popen(sys.argv[1:], start_new_session=True).wait())"
)


def test_a_stopped_engines_worker_that_outlives_its_leader_is_not_foreign(tmp_path, engines):
    host, _ = nvml_host(tmp_path, "matching")
    engines.append(host)
    memory = {**MEMORY, "CAPYCTL_SIM_GPUS": "80GiB", "CAPYCTL_SIM_STATE_DIR": str(tmp_path / "sim")}
    command = f"{sys.executable} -c {shlex.quote(_LEADER)} {SIM} vllm"
    host.launch(InstanceRequest(
        instance_id="a", kind="vllm", command=command, source="/models/a", served_name="a",
        gpu_indices=[0], env=memory,
    ))  # fmt: skip
    host.wait_ready("a", 60)
    leader = psutil.Process(host.instance("a").pid)
    (worker,) = leader.children()
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB
    stopping = threading.Thread(target=host.stop, args=("a", 3))
    stopping.start()
    try:
        deadline = time.monotonic() + 30
        while leader.is_running():  # the leader is gone; the stop waits for its worker
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert worker.is_running()
        assert stopping.is_alive()
        assert host.foreign(unified=False)["gpu0"] == 2 * GIB
    finally:
        worker.kill()
        stopping.join(30)
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB  # gone, and not counted


def test_on_the_device_path_a_gpu_a_step_holds_is_not_read_for_foreign_memory(
    tmp_path, engines, monkeypatch
):
    """Where NVML cannot tell the engine's pids, an engine's share is what its steps
    measured: while a wake is under way its GPU has grown and its share is not yet known,
    so the growth read as foreign. That GPU is now left out of the reading (its last
    figure stands) until the step ends."""
    host, launch = nvml_host(tmp_path, "foreign")
    engines.append(host)
    launch("a")
    host.wait_ready("a", 60)
    host.park("a", "ram", 60)
    answered, checked = threading.Event(), threading.Event()
    health = process_module.wait_ready

    def slow_health(*args, **kwargs):  # the engine answered its wake: its 16 GiB are back
        answered.set()
        checked.wait(30)
        return health(*args, **kwargs)

    monkeypatch.setattr("hostagent.parking.wait_ready", slow_health)
    waking = threading.Thread(target=host.wake, args=("a", "ram", 60))
    waking.start()
    try:
        assert answered.wait(30)
        assert "gpu0" not in host.foreign(unified=False)
    finally:
        checked.set()
        waking.join(60)
    assert host.usage("a").gpu == {0: 16 * GIB}
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB


def test_on_the_device_path_a_start_under_way_is_read_for_foreign_memory(tmp_path, engines):
    """A start holds its GPUs too (its share is measured when it ends), but what they grew
    by since its launch already counts as its engine's: the foreign figure of its GPU is
    read as ever, not left standing for the minutes a load can take."""
    host, launch = nvml_host(tmp_path, "foreign")
    engines.append(host)
    gate = tmp_path / "a-loads"
    launch("a", CAPYCTL_SIM_LOAD_GATE=str(gate))
    starting = threading.Thread(target=host.wait_ready, args=("a", 60))
    starting.start()
    try:
        deadline = time.monotonic() + 30
        while not gate.with_name("a-loads.waiting").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert host.foreign(unified=False)["gpu0"] == 2 * GIB
    finally:
        gate.touch()
        starting.join(60)
    assert host.foreign(unified=False)["gpu0"] == 2 * GIB


def test_the_tolerance_of_a_park_confirmed_by_device():
    # 5% of the share, at least 1 GiB (a sleeping engine's context), at most half of it.
    assert release_tolerance(80 * GIB) == 4 * GIB
    assert release_tolerance(16 * GIB) == 1 * GIB
    assert release_tolerance(1 * GIB) == 512 * MIB
    assert released_on_device(16 * GIB, 15 * GIB)
    assert not released_on_device(16 * GIB, 15 * GIB - 1)
    assert not released_on_device(1 * GIB, 0)  # a park that frees nothing, however small


def test_a_lease_past_its_bound_is_taken_over_and_said_lost():
    leases = DeviceLeases()
    start = leases.acquire("the start of a", [0], 0.3)
    other_gpu = leases.acquire("the park of c", [1], 60)  # another GPU: no wait
    got: dict[str, Lease] = {}
    waiting = threading.Thread(target=lambda: got.update(b=leases.acquire("b", [0, 1], 60)))
    waiting.start()
    time.sleep(0.1)
    leases.release(other_gpu)
    assert waiting.is_alive()  # gpu0 is still held
    waiting.join(5)
    assert start.lost  # its caller never let go: taken over once past its 0.3 s
    assert not got["b"].lost
    leases.release(got["b"])
    assert not leases.acquire("d", [0, 1], 1).lost


def test_a_host_agent_lists_simulated_pids_as_told_and_refuses_a_bad_value(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPYCTL_SIM_GPUS", "24GiB")
    monkeypatch.setenv("CAPYCTL_SIM_PIDS", "foreign")
    probe = probe_from_env(AgentFiles(tmp_path))
    write_allocation(tmp_path / "sim-gpus", os.getpid(), {0: 4 * GIB}, 0)
    assert probe.gpu_processes() == {os.getpid() + HOST_PID: {0: 4 * GIB}}
    assert probe.process_usage(os.getpid()).gpu == {}
    assert probe.inventory().measures == "device before/after"
    monkeypatch.setenv("CAPYCTL_SIM_PIDS", "hidden")
    with pytest.raises(AgentError, match="CAPYCTL_SIM_PIDS='hidden' must be one of: own,"):
        probe_from_env(AgentFiles(tmp_path))


def test_a_start_stopped_before_it_was_ready_lets_its_gpu_go(tmp_path, engines):
    """A start holds its GPU from launch to ready; a stop in between (a model stopped while
    it starts, or a launch whose caller failed) lets it go, so the next start is measured."""
    host, launch = nvml_host(tmp_path, "foreign")
    engines.append(host)
    launch("a", CAPYCTL_SIM_LOAD_GATE=str(tmp_path / "never"))
    host.stop("a", 2)
    launch("b", CAPYCTL_SIM_GPU_BYTES="8GiB")  # would wait for a's lease until its bound
    host.wait_ready("b", 60)
    assert host.usage("b").gpu == {0: 8 * GIB}
    assert host.inventory().measures == "device before/after"


def test_an_agent_restarted_keeps_what_its_engines_were_measured_holding(tmp_path, engines):
    host, launch = nvml_host(tmp_path, "foreign")
    engines.append(host)
    launch("a")
    host.wait_ready("a", 60)
    host.park("a", "ram", 60)
    again = HostRuntime(host.probe, tmp_path / "logs", tmp_path / "instances.json")
    assert again.restore() == ["a"]
    assert again.usage("a").gpu == {0: 512 * MIB}  # its residual, as measured
    assert again.inventory().measures == "device before/after"
    again.wake("a", "ram", 60)
    assert again.usage("a").gpu == {0: 16 * GIB}
