"""A host whose GPU probe cannot see its engines' pids (a container without the host's
pids: NVML lists the host's pids, or none, or no figures) measures each engine by its
GPU's used memory before and after each step: a start records what the engine really
holds, and a park is confirmed by the GPU's use falling. The old probe found no memory of
any engine there: a start kept its claim as a guess, and every park was taken for one
that kept its memory, so the model was stopped and its engine marked."""

import json

import pytest

from capyctl.engines.models import Engine
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler import actions
from capyctl.scheduler.drivers import set_local_driver
from capyctl.scheduler.reconcile import reconcile
from capyctl.web.dashboard import dashboard_data
from hostagent.simgpu import SimSpec
from tests.scheduling import GIB, MIB, SIM, SIM_ENV, deployment, entries, make_host, state

pytestmark = pytest.mark.database

DEVICE = "device before/after"


@pytest.fixture(params=["foreign", "empty", "unknown"])
def hidden_pids(request, tmp_path, settings):
    """A 24 GiB simulated GPU whose probe lists the engines' processes as NVML does in a
    container: by pids of another namespace, not at all, or with no figure."""
    driver = make_host(
        tmp_path, settings, SimSpec(unified=False, sizes=[24 * GIB], pids=request.param)
    )
    driver.runtime.release_timeout = 2.0
    yield driver
    driver.stop_all(grace_seconds=2)
    set_local_driver(None)


def gpu_ledger_matches_the_device(driver):
    counted = sum(e.bytes for e in LedgerEntry.objects.filter(pool="gpu0"))
    return counted == driver.devices()[0].used_bytes


@pytest.mark.django_db(transaction=True)
def test_a_start_records_the_real_share_and_a_park_is_confirmed_by_the_device(hidden_pids, cli):
    # Each model is told 16 GiB (its claim); its engine takes 12 GiB of the GPU.
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm",
               env={**SIM_ENV, "CAPYCTL_SIM_GPU_BYTES": "12GiB"})  # fmt: skip
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    assert entries("a")["gpu0"] == ("held", 12 * GIB)  # measured: not the 16 GiB claim
    assert gpu_ledger_matches_the_device(hidden_pids)

    # b's 16 GiB does not fit beside a: a is parked, its park confirmed by the GPU's fall.
    actions.ensure_ready(b.pk)
    assert state("a") == ("parked", "ram")
    assert state("b") == ("ready", "")
    assert entries("a")["gpu0"] == ("held", 512 * MIB)  # its residual, measured
    assert entries("b")["gpu0"] == ("held", 12 * GIB)
    assert gpu_ledger_matches_the_device(hidden_pids)
    assert Engine.objects.get(name="sim-vllm").park_unverified_at is None
    assert not Event.objects.filter(kind="engine.park_unverified").exists()
    parked = Event.objects.get(kind="deployment.parked", subject="a").message
    assert "not confirmed" not in parked

    # And back: b parks, a wakes to its share again.
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "ram")
    assert entries("a")["gpu0"] == ("held", 12 * GIB)
    assert gpu_ledger_matches_the_device(hidden_pids)

    # The host says how it measures: status, its JSON, the host list and the dashboard.
    local = Host.objects.get(name="local")
    reconcile(local.pk)
    # (No server runs in this test: status shows the host's state as last known.)
    assert "(online); probe simulated; measures device before/after)" in cli("status").out
    (host,) = json.loads(cli("status", "--json").out)["hosts"]
    assert host["measures"] == DEVICE
    assert "lists no process of a" in host["measures_reason"] or (
        "no memory figure for a" in host["measures_reason"]
    )
    (listed,) = json.loads(cli("host", "list", "--json").out)
    assert listed["measures"] == DEVICE
    assert "  device before/after  " in cli("host", "list").out
    (card,) = dashboard_data()["hosts"]
    assert card["measures"] == DEVICE
    (said,) = Event.objects.filter(kind="host.measures").values_list("message", flat=True)
    assert said.startswith(f"host local measures GPU memory by {DEVICE} (each GPU's use")


@pytest.mark.django_db(transaction=True)
def test_a_park_that_keeps_its_memory_is_still_found_out(hidden_pids):
    add_engine("sticky", kind="vllm", command=f"{SIM} vllm",
               env={**SIM_ENV, "CAPYCTL_SIM_KEEP_MEMORY": "1"})  # fmt: skip
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    a = deployment("a", engine="sticky")
    b = deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk, timeout=20)
    assert state("a") == ("stopped", "")  # stopped instead, as on a host that sees pids
    assert state("b") == ("ready", "")
    engine = Engine.objects.get(name="sticky")
    assert engine.park_unverified_at is not None
    assert "its GPUs' used memory did not fall by its share" in engine.park_unverified_reason


@pytest.mark.django_db(transaction=True)
def test_a_remote_host_says_how_it_measures_in_its_inventory(monkeypatch, cli):
    from django.utils import timezone

    from capyctl.scheduler import remote_hosts

    reported = {"probe": "nvml", "ram_total_bytes": 2**36, "gpus": [], "measures": "per process"}
    Host.objects.create(
        name="gpu-box", address="127.0.0.1:7443", is_local=False, state=Host.State.ONLINE,
        enrolled_at=timezone.now(), cert_fingerprint="ab" * 32, inventory=dict(reported),
    )  # fmt: skip
    monkeypatch.setattr(remote_hosts, "agent_call", lambda host, method, path: dict(reported))
    remote_hosts.poll_hosts()
    assert not Event.objects.filter(kind="host.measures").exists()  # nothing changed
    reported |= {"measures": DEVICE, "measures_reason": "NVML lists pids (4194311) of which …"}
    remote_hosts.poll_hosts()
    remote_hosts.poll_hosts()  # said once, when it changed
    (said,) = Event.objects.filter(kind="host.measures").values_list("message", flat=True)
    assert said.startswith(f"host gpu-box measures GPU memory by {DEVICE} (each GPU's use")
    assert said.endswith("): NVML lists pids (4194311) of which …")
    listed = {h["name"]: h["measures"] for h in json.loads(cli("host", "list", "--json").out)}
    assert listed["gpu-box"] == DEVICE
