"""Ledger admission: never over-commits a pool, even under concurrent writers."""

import multiprocessing
import threading

import pytest
from django.db import connection

from capyctl.deployments.models import Deployment
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import (
    InsufficientMemoryError,
    admit,
    host_lock,
    mark_unconfirmed,
    overcommitted,
    release,
    set_foreign,
    set_measured,
)
from capyctl.scheduler.host_states import ensure_local_host
from hostagent.probe import SimulatedProbe
from hostagent.simgpu import SimSpec
from tests.ledger_hammer import hammer, process_main
from tests.watching import Watcher

GIB = 1024**3


@pytest.fixture
def gpu_host(db, tmp_path, settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "GPU_RESERVE_BYTES": 0, "RAM_RESERVE_BYTES": 0}
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB, 24 * GIB]), tmp_path)
    return ensure_local_host(probe.inventory())


@pytest.fixture
def models(gpu_host):
    add_engine("v1", kind="vllm", command="vllm")
    return [
        add_deployment(DeploymentSpec(name=f"m{i}", engine="v1", source="m")).pk for i in range(12)
    ]


def free(host, pool):
    return {p.pool: p for p in pool_usage(host)}[pool].free_bytes


def test_admission_promises_then_refuses_naming_the_pool(gpu_host, models):
    a, b = models[:2]
    with host_lock(gpu_host.pk) as host:
        admit(host, a, {"gpu0": 16 * GIB})
    assert free(gpu_host, "gpu0") == 8 * GIB
    with pytest.raises(InsufficientMemoryError) as info, host_lock(gpu_host.pk) as host:
        admit(host, b, {"gpu0": 16 * GIB})
    assert str(info.value) == "not enough memory on local: gpu0 needs 16.0 GiB, has 8.0 GiB free"
    assert not LedgerEntry.objects.filter(deployment_id=b).exists()


def test_a_deployment_asks_for_its_total_not_an_increment(gpu_host, models):
    a = models[0]
    with host_lock(gpu_host.pk) as host:
        admit(host, a, {"gpu0": 20 * GIB})
        admit(host, a, {"gpu0": 22 * GIB})  # replaces its own 20, does not add to it
    assert free(gpu_host, "gpu0") == 2 * GIB
    with host_lock(gpu_host.pk) as host:
        set_measured(host, a, {"gpu0": 15 * GIB})
    entry = LedgerEntry.objects.get(deployment_id=a)
    assert (entry.bytes, entry.status) == (15 * GIB, "held")


def test_unconfirmed_and_foreign_memory_keep_counting(gpu_host, models):
    a, b = models[:2]
    with host_lock(gpu_host.pk) as host:
        admit(host, a, {"gpu0": 16 * GIB})
        mark_unconfirmed(host, a, "park answered but the probe still sees it")
        set_foreign(host, {"gpu1": 20 * GIB})
    usage = {p.pool: p for p in pool_usage(gpu_host)}
    assert usage["gpu0"].unconfirmed_bytes == 16 * GIB
    assert usage["gpu1"].foreign_bytes == 20 * GIB
    with pytest.raises(InsufficientMemoryError), host_lock(gpu_host.pk) as host:
        admit(host, b, {"gpu0": 10 * GIB})
    with host_lock(gpu_host.pk) as host:
        release(host, a)
        set_foreign(host, {"gpu1": 0})
        admit(host, b, {"gpu0": 10 * GIB, "gpu1": 24 * GIB})
    assert overcommitted(gpu_host) == []


def _database_url() -> str:
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.mark.django_db(transaction=True)
def test_concurrent_threads_and_processes_never_overcommit_a_pool(tmp_path, settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "GPU_RESERVE_BYTES": 0, "RAM_RESERVE_BYTES": 0}
    probe = SimulatedProbe(SimSpec(unified=False, sizes=[24 * GIB, 24 * GIB]), tmp_path)
    host = ensure_local_host(probe.inventory())
    Host.objects.filter(pk=host.pk).update(
        inventory={**host.inventory, "ram_total_bytes": 32 * GIB}
    )
    host.refresh_from_db()
    add_engine("v1", kind="vllm", command="vllm")
    ids = [
        add_deployment(DeploymentSpec(name=f"m{i}", engine="v1", source="m")).pk for i in range(10)
    ]

    def look() -> list[str]:
        return [f"{u.pool}: {u.used_bytes} > {u.capacity_bytes}" for u in overcommitted(host)]

    results: list[int] = []
    threads = [
        threading.Thread(target=lambda s=seed: results.append(hammer(host.pk, ids, s, 60)))
        for seed in range(4)
    ]
    context = multiprocessing.get_context("spawn")
    with Watcher(look) as watcher, context.Pool(2) as pool:
        pending = [
            pool.apply_async(
                process_main,
                (_database_url(), str(settings.DATA_DIR), host.pk, ids),
                {"seed": 100 + seed, "steps": 60},
            )
            for seed in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        process_results = [p.get(timeout=240) for p in pending]
    assert len(results) == 4
    assert results == [0, 0, 0, 0]
    assert process_results == [0, 0]
    assert watcher.verify(min_looks=10) == []
    assert LedgerEntry.objects.exists()  # the hammering really admitted things
    assert Deployment.objects.count() == 10
