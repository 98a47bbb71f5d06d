"""Constraints the database itself keeps, and pool capacities from a host's inventory."""

import pytest
from django.db import IntegrityError, transaction

from capyctl.deployments.models import Deployment, DeploymentAlias, Instance
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.scheduler.host_states import ensure_local_host
from hostagent.probe import SimulatedProbe, read_inventory
from hostagent.simgpu import SimSpec

GIB = 1024**3


@pytest.fixture
def host(db, tmp_path):
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB, 24 * GIB]), tmp_path)
    return ensure_local_host(probe.inventory())


@pytest.fixture
def chat(host):
    add_engine("v1", kind="vllm", command="vllm")
    return add_deployment(DeploymentSpec(name="chat", engine="v1", source="/m", host="local"))


def test_a_deployment_has_at_most_one_live_engine_process(chat, host):
    Instance.objects.create(deployment=chat, host=host, launch_key="k1", state="running")
    with pytest.raises(IntegrityError), transaction.atomic():
        Instance.objects.create(deployment=chat, host=host, launch_key="k2", state="launching")
    Instance.objects.filter(deployment=chat).update(state="exited")
    Instance.objects.create(deployment=chat, host=host, launch_key="k3", state="launching")


def test_one_ledger_entry_per_deployment_and_pool(chat, host):
    LedgerEntry.objects.create(host=host, pool="gpu0", deployment=chat, bytes=GIB, status="held")
    with pytest.raises(IntegrityError), transaction.atomic():
        LedgerEntry.objects.create(
            host=host, pool="gpu0", deployment=chat, bytes=1, status="promised"
        )
    LedgerEntry.objects.create(host=host, pool="gpu0", deployment=None, bytes=GIB, status="foreign")
    with pytest.raises(IntegrityError), transaction.atomic():
        LedgerEntry.objects.create(
            host=host, pool="gpu0", deployment=None, bytes=1, status="foreign"
        )
    with pytest.raises(IntegrityError), transaction.atomic():
        LedgerEntry.objects.create(host=host, pool="gpu1", deployment=chat, bytes=-1, status="held")


def test_gpu_memory_is_bytes_or_a_fraction_never_both(chat):
    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.filter(pk=chat.pk).update(gpu_memory_bytes=GIB, gpu_memory_fraction=0.5)
    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.filter(pk=chat.pk).update(gpu_memory_fraction=1.5)


def test_alias_names_are_unique(chat):
    DeploymentAlias.objects.create(name="qwen", deployment=chat)
    with pytest.raises(IntegrityError), transaction.atomic():
        DeploymentAlias.objects.create(name="qwen", deployment=chat)


def test_pools_capacity_is_total_minus_reserve(host, chat, settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "GPU_RESERVE_BYTES": GIB, "RAM_RESERVE_BYTES": 2 * GIB}
    LedgerEntry.objects.create(
        host=host, pool="gpu0", deployment=chat, bytes=10 * GIB, status="held"
    )
    LedgerEntry.objects.create(host=host, pool="gpu0", deployment=None, bytes=GIB, status="foreign")
    usage = {p.pool: p for p in pool_usage(host)}
    assert set(usage) == {"gpu0", "gpu1", "ram"}
    assert usage["gpu0"].capacity_bytes == 23 * GIB
    assert usage["gpu0"].held_bytes == 10 * GIB
    assert usage["gpu0"].foreign_bytes == GIB
    assert usage["gpu0"].free_bytes == 12 * GIB
    assert usage["gpu1"].free_bytes == 23 * GIB
    Host.objects.filter(pk=host.pk).update(gpu_reserve_bytes=4 * GIB)
    host.refresh_from_db()
    assert {p.pool: p.capacity_bytes for p in pool_usage(host)}["gpu1"] == 20 * GIB


def test_unified_memory_is_one_pool(db, tmp_path):
    probe = SimulatedProbe(SimSpec(unified=True, sizes=[128 * GIB]), tmp_path)
    host = ensure_local_host(probe.inventory())
    assert host.pools() == [{"pool": "unified", "total_bytes": 128 * GIB}]


def test_a_host_without_gpus_has_only_ram(db, monkeypatch):
    import pynvml

    def no_library():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    inventory = read_inventory(None)
    assert inventory.probe == "none"
    assert inventory.gpus == []
    host = ensure_local_host(inventory)
    assert [p["pool"] for p in host.pools()] == ["ram"]
