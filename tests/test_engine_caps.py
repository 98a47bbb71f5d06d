"""Every kind holds its engine to the ledger's claim by the engine's own means, and a start
is measured against its claim: an engine past it (and the tolerance) is stopped with the
figures, or, where the deployment says ``over_claim raise``, its claim is raised.

TensorFold has no fraction flag: it sizes its budget to the card's free memory less a
reserve of max(4 GiB, a tenth), under ``TENSORFOLD_CUDA_MEMORY_LIMIT_GB``. Launched without
that cap, as before, it held most of a card whose ledger counted its claim."""

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from capyctl.deployments.models import Deployment, Instance
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.scheduler import actions, estimates, snapshots
from capyctl.scheduler.errors import EngineFailedError
from hostagent.kinds import LaunchSpec, get_kind
from hostagent.kinds.tensorfold import TensorFoldKind
from hostagent.probe import ProcessUsage
from hostagent.sim.memory import SimMemory
from hostagent.sim.options import parse_options, read_knobs
from hostagent.simgpu import SIM_GPUS_ENV, SIM_STATE_ENV, SimSpec, write_allocation
from hostagent.versions import EngineFeatures
from tests.scheduling import GIB, MIB, SIM, SIM_ENV, deployment, entries, make_host, state

CUDA_LIMIT = "TENSORFOLD_CUDA_MEMORY_LIMIT_GB"


def spec(**extra: Any) -> LaunchSpec:
    values: dict[str, Any] = {
        "command": "engine",
        "source": "/models/qwen",
        "served_name": "chat",
        "port": 41000,
        "api_key": "launch-key",
        "gpu_indices": [0],
        "run_dir": Path("/data/run/i1"),
    }
    values.update(extra)
    return LaunchSpec(**values)


# --- each kind's cap, in the launch it builds --------------------------------------------


def test_tensorfold_is_capped_at_its_claim_less_its_context():
    launch = get_kind("tensorfold").build_launch(spec(claim_bytes=16 * GIB))
    # 16 GiB less the 512 MiB its CUDA context takes beside its budget.
    assert launch.env[CUDA_LIMIT] == "15.50"
    assert launch.env["TENSORFOLD_MEMORY_LIMIT_GB"] == "15.50"  # its MLX build's cap
    assert not any("LIMIT" in arg for arg in launch.argv)
    # Rounded down: never a byte past the claim.
    odd = get_kind("tensorfold").build_launch(spec(claim_bytes=10 * GIB + 123_456_789))
    assert float(odd.env[CUDA_LIMIT]) * GIB <= 10 * GIB + 123_456_789 - 512 * MIB
    assert get_kind("tensorfold").build_launch(spec()).env.get(CUDA_LIMIT) is None


@pytest.mark.parametrize(
    ("theirs", "launched"), [("8", "8"), ("40", "15.50"), ("lots", "15.50"), ("-1", "15.50")]
)
def test_an_operators_own_tensorfold_cap_stands_only_if_lower(theirs, launched):
    launch = get_kind("tensorfold").build_launch(
        spec(claim_bytes=16 * GIB, env={CUDA_LIMIT: theirs})
    )
    assert launch.env[CUDA_LIMIT] == launched


def test_vllm_is_given_its_claims_share_of_the_device():
    launch = get_kind("vllm").build_launch(spec(memory_fraction=16 / 24, claim_bytes=16 * GIB))
    flag = launch.argv.index("--gpu-memory-utilization")
    assert launch.argv[flag + 1] == "0.6666"  # of the whole device, per instance: rounded down


def test_sglang_counts_what_else_the_gpu_holds():
    # SGLang's static part is total x fraction less what the card holds when it sizes its
    # pool: with 8 GiB of another engine there, its fraction must cover that too.
    launch = get_kind("sglang").build_launch(
        spec(memory_fraction=8 / 24, claim_bytes=8 * GIB, gpu_memory=[(16 * GIB, 24 * GIB)])
    )
    flag = launch.argv.index("--mem-fraction-static")
    assert launch.argv[flag + 1] == "0.5833"  # (8 held + 8 claimed - 2 outside static) / 24
    alone = get_kind("sglang").build_launch(spec(memory_fraction=0.5, claim_bytes=12 * GIB))
    assert alone.argv[alone.argv.index("--mem-fraction-static") + 1] == "0.5000"


def test_llamacpp_fits_itself_to_leave_all_but_its_claim_free():
    fit = EngineFeatures(version="b7000", flags=frozenset({"--fit", "--fit-target"}))
    launch = get_kind("llamacpp").build_launch(
        spec(claim_bytes=8 * GIB, gpu_memory=[(20 * GIB, 24 * GIB)], features=fit)
    )
    assert launch.argv[-4:] == ["--fit", "on", "--fit-target", "12288"]  # MiB left free
    old = EngineFeatures(version="b4000", flags=frozenset({"--ctx-size"}))
    without = get_kind("llamacpp").build_launch(
        spec(claim_bytes=8 * GIB, gpu_memory=[(20 * GIB, 24 * GIB)], features=old)
    )
    assert "--fit" not in without.argv  # a build without --fit: the start's check holds it
    own = get_kind("llamacpp").build_launch(
        spec(
            claim_bytes=8 * GIB,
            gpu_memory=[(20 * GIB, 24 * GIB)],
            features=fit,
            extra_args=["--fit-target", "2048"],
        )
    )
    assert own.argv.count("--fit-target") == 1


# --- the simulated TensorFold takes what the real one takes ------------------------------


def sim_tensorfold(monkeypatch, tmp_path, **env):
    monkeypatch.setenv(SIM_GPUS_ENV, "24GiB")
    monkeypatch.setenv(SIM_STATE_ENV, str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("CAPYCTL_SIM_GPU_BYTES", CUDA_LIMIT, "TENSORFOLD_MEMORY_RESERVE_GIB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    options = parse_options(["tensorfold", "serve", "/models/m", "--port", "41000"])
    memory = SimMemory(options, read_knobs())
    memory.loaded = memory.weights_on_gpu = memory.kv_on_gpu = True
    return memory.gpu_bytes()[0]


def test_the_simulated_tensorfold_takes_the_free_memory_less_its_reserve(monkeypatch, tmp_path):
    residual = 256 * MIB  # its CUDA context, beside its budget
    assert sim_tensorfold(monkeypatch, tmp_path) == residual + 20 * GIB  # 24 - max(4, 2.4)
    # Another process holds 8 GiB: free is 16, its reserve still 4 GiB.
    write_allocation(tmp_path, os.getppid(), {0: 8 * GIB}, 0)
    assert sim_tensorfold(monkeypatch, tmp_path) == residual + 12 * GIB
    assert sim_tensorfold(monkeypatch, tmp_path, **{CUDA_LIMIT: "6"}) == residual + 6 * GIB
    reserve = {"TENSORFOLD_MEMORY_RESERVE_GIB": "2"}
    assert sim_tensorfold(monkeypatch, tmp_path, **reserve) == residual + 14 * GIB
    with pytest.raises(SystemExit, match="must be a positive number in GiB"):
        sim_tensorfold(monkeypatch, tmp_path, **{CUDA_LIMIT: "0"})


def test_on_a_real_device_the_simulated_tensorfold_reads_what_cuda_has_free(monkeypatch, tmp_path):
    from tests.test_sim_cuda import FakeCuda, FakeTorch

    @dataclass
    class BusyCuda(FakeCuda):
        free: int = 0

        def mem_get_info(self, device: int = 0) -> tuple[int, int]:
            return self.free, self.totals[device]

    fake = FakeTorch(BusyCuda([80 * GIB], free=60 * GIB))  # 20 GiB held by others
    monkeypatch.setattr("hostagent.sim.memory.open_torch", lambda: fake)
    monkeypatch.setenv(SIM_STATE_ENV, str(tmp_path))
    options = parse_options(["tensorfold", "serve", "m", "--port", "1"])
    knobs = replace(read_knobs(), device="cuda", residual_bytes=0, gpu_bytes=None,
                    memory_limit_gb=None, memory_reserve_gib=None)  # fmt: skip
    assert SimMemory(options, knobs).claims == {0: 52 * GIB}  # 60 free - max(4, 8 GiB)
    capped = replace(knobs, memory_limit_gb="20")
    assert SimMemory(options, capped).claims == {0: 20 * GIB}


# --- through CapyCTL ---------------------------------------------------------------------


def tensorfold_engine(name="sim-tf"):
    # No CAPYCTL_SIM_GPU_BYTES: it takes what TensorFold takes. Its deployments' source is
    # one word, a name the engine resolves (nothing for CapyCTL to fetch).
    return add_engine(name, kind="tensorfold", command=f"{SIM} tensorfold", env=SIM_ENV)


def uncapped(monkeypatch):
    """The launch as it was: no cap in TensorFold's environment."""
    monkeypatch.setattr(TensorFoldKind, "cap_env", lambda self, spec: {})


@pytest.mark.django_db(transaction=True)
def test_a_capped_tensorfold_holds_what_the_ledger_says(gpu24):
    tensorfold_engine()
    tf = deployment("tf", engine="sim-tf", gib=12, source="weights")
    actions.ensure_ready(tf.pk)
    assert state("tf") == ("ready", "")
    status, held = entries("tf")["gpu0"]
    assert status == "held"
    assert held <= 12 * GIB + estimates.over_claim_tolerance(12 * GIB)
    assert held >= 11 * GIB  # its budget: the claim less its context allowance, plus context
    assert gpu24.devices()[0].used_bytes == held
    # A second one beside it: the card has 12 GiB free, its reserve takes 4 of them.
    tensorfold_engine("sim-tf-2")
    small = deployment("small", engine="sim-tf-2", gib=8, source="weights")
    actions.ensure_ready(small.pk)
    assert state("small") == ("ready", "")
    assert entries("small")["gpu0"][1] <= 8 * GIB
    assert gpu24.devices()[0].used_bytes <= 20 * GIB


@pytest.mark.django_db(transaction=True)
def test_an_uncapped_tensorfold_grabs_the_card_and_is_stopped(gpu24, monkeypatch):
    uncapped(monkeypatch)
    tensorfold_engine()
    tf = deployment("tf", engine="sim-tf", gib=12, source="weights")
    with pytest.raises(EngineFailedError, match=r"holds 20\.5 GiB on gpu0"):
        actions.ensure_ready(tf.pk)
    d = Deployment.objects.get(name="tf")
    assert d.observed_state == "failed"
    assert d.state_reason == (
        "its engine holds 20.5 GiB on gpu0, more than its claim of 12.0 GiB per GPU and the "
        "tolerance of 614.4 MiB, so it was stopped (cap the engine lower, raise --gpu-memory, "
        "or set over_claim to raise)"
    )
    assert "\n" not in d.state_reason
    assert entries("tf") == {}  # released with its engine
    assert gpu24.devices()[0].used_bytes == 0  # the engine is gone
    assert d.gpu_memory_bytes == 12 * GIB
    failed = Event.objects.get(kind="deployment.failed", subject="tf")
    assert "holds 20.5 GiB on gpu0" in failed.message


@pytest.mark.django_db(transaction=True)
def test_over_claim_raise_raises_the_claim_and_says_so(gpu24, monkeypatch):
    uncapped(monkeypatch)
    tensorfold_engine()
    tf = deployment("tf", engine="sim-tf", gib=12, source="weights", over_claim="raise")
    actions.ensure_ready(tf.pk)
    assert state("tf") == ("ready", "")
    measured = 20 * GIB + 512 * MIB
    assert entries("tf")["gpu0"] == ("held", measured)
    d = Deployment.objects.get(name="tf")
    assert d.gpu_memory_bytes == measured
    assert Instance.objects.get(deployment=d, state="running").claim_bytes == measured
    raised = Event.objects.get(kind="deployment.claim_raised", subject="tf")
    assert raised.level == "warning"
    assert raised.message == (
        "tf's engine holds 20.5 GiB per GPU, more than its claim of 12.0 GiB: its claim is "
        "raised to 20.5 GiB (over_claim raise)"
    )


@pytest.mark.django_db(transaction=True)
def test_an_engine_within_its_tolerance_is_not_stopped(gpu24):
    # llama-server holds what it holds (this build lists no --fit): 12.5 GiB on a 12 GiB
    # claim is inside max(5%, 512 MiB).
    add_engine("sim-llama", kind="llamacpp", command=f"{SIM} llamacpp",
               env={**SIM_ENV, "CAPYCTL_SIM_GPU_BYTES": "12.5GiB"})  # fmt: skip
    d = deployment("llama", engine="sim-llama", gib=12)
    actions.ensure_ready(d.pk)
    assert state("llama") == ("ready", "")
    assert entries("llama")["gpu0"] == ("held", 12 * GIB + 512 * MIB)


def test_an_unknown_figure_is_never_over_its_claim():
    host = Host(name="gpu-box", inventory={"unified": False})  # unsaved: only read
    usage = ProcessUsage(gpu={0: None, 1: 30 * GIB}, host_bytes=0)
    figures = snapshots.measured(host, ["gpu0", "gpu1"], usage, 12 * GIB)
    assert figures["gpu0"] == 12 * GIB  # no figure: the claim stands
    assert estimates.over_claim(figures, ["gpu0", "gpu1"], 12 * GIB) == {"gpu1": 30 * GIB}
    assert estimates.over_claim({"gpu0": 12 * GIB}, ["gpu0"], 12 * GIB) == {}
    assert estimates.over_claim_tolerance(4 * GIB) == 512 * MIB
    assert estimates.over_claim_tolerance(40 * GIB) == 2 * GIB


@pytest.fixture(params=["foreign", "unknown"])
def measured_by_device(request, tmp_path, settings):
    """A host whose probe cannot see its engines' processes: starts are measured by what
    the GPU's use grew by."""
    from capyctl.scheduler.drivers import set_local_driver

    driver = make_host(
        tmp_path, settings, SimSpec(unified=False, sizes=[24 * GIB], pids=request.param)
    )
    yield driver
    driver.stop_all(grace_seconds=2)
    set_local_driver(None)


@pytest.mark.django_db(transaction=True)
def test_measured_by_device_a_capped_tensorfold_is_not_failed(measured_by_device):
    tensorfold_engine()
    tf = deployment("tf", engine="sim-tf", gib=12, source="weights")
    actions.ensure_ready(tf.pk)
    assert state("tf") == ("ready", "")
    assert entries("tf")["gpu0"][1] <= 12 * GIB
