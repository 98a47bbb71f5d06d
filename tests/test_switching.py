"""Switching on a simulated 24 GiB GPU with simulated engines (DESIGN §5)."""

import threading

import pytest
from django.db import connection

from capyctl.deployments.models import Deployment
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.services import overcommitted
from capyctl.scheduler import operations
from capyctl.scheduler.drivers import set_local_driver
from hostagent.simgpu import SimSpec
from tests.scheduling import (
    GIB,
    MIB,
    SIM,
    SIM_ENV,
    deployment,
    entries,
    make_host,
    state,
    vllm_engine,
)


def gpu_ledger_matches_probe(driver):
    counted = sum(e.bytes for e in LedgerEntry.objects.filter(pool="gpu0"))
    return counted == driver.devices()[0].used_bytes


@pytest.mark.django_db(transaction=True)
def test_a_then_b_parks_a_in_ram_and_wakes_b(gpu24):
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    operations.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert entries("a")["gpu0"][0] == "held"
    assert abs(entries("a")["gpu0"][1] - 16 * GIB) < 16 * MIB

    operations.ensure_ready(b.pk)
    assert state("a") == ("parked", "ram")
    assert state("b") == ("ready", "")
    assert entries("a")["gpu0"] == ("held", 512 * MIB)
    assert entries("a")["ram"][1] >= 8 * GIB  # the weights copy, counted in host RAM
    measured_copy = Deployment.objects.get(name="a").measured_weights_bytes
    assert measured_copy is not None
    assert abs(measured_copy - 8 * GIB) < 64 * MIB  # remembered for the next plan
    assert gpu_ledger_matches_probe(gpu24)
    assert overcommitted(Host.objects.get(name="local")) == []
    parked = Event.objects.get(kind="deployment.parked", subject="a")
    assert "to make room for b" in parked.message
    assert parked.duration_ms is not None

    # And back: b parks, a wakes from RAM.
    operations.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "ram")
    assert gpu_ledger_matches_probe(gpu24)
    assert Event.objects.filter(kind="deployment.woke", subject="a").exists()


@pytest.mark.django_db(transaction=True)
def test_deep_when_host_ram_cannot_hold_the_copy(gpu24, settings):
    import psutil

    total = psutil.virtual_memory().total
    settings.CAPYCTL = {**settings.CAPYCTL, "RAM_RESERVE_BYTES": total - 6 * GIB}
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    operations.ensure_ready(a.pk)
    operations.ensure_ready(b.pk)
    assert state("a") == ("parked", "deep")
    assert entries("a")["gpu0"] == ("held", 512 * MIB)
    operations.ensure_ready(a.pk)  # a deep wake reloads the weights; b goes deep too
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "deep")


@pytest.mark.django_db(transaction=True)
def test_a_kind_that_cannot_park_is_stopped_and_started_again(gpu24):
    vllm_engine()
    tf_env = {**SIM_ENV, "CAPYCTL_SIM_GPU_BYTES": "16GiB"}  # TensorFold takes no fraction flag
    add_engine("sim-tf", kind="tensorfold", command=f"{SIM} tensorfold", env=tf_env)
    tf = deployment("tf", engine="sim-tf")
    b = deployment("b")
    operations.ensure_ready(tf.pk)
    operations.ensure_ready(b.pk)
    assert state("tf") == ("stopped", "")
    assert entries("tf") == {}
    stopped = Event.objects.get(kind="deployment.stopped", subject="tf")
    assert "stopped tf instead of parking: its engine cannot park" in stopped.message
    operations.ensure_ready(tf.pk)  # its next request starts it again
    assert state("tf") == ("ready", "")
    assert state("b") == ("parked", "ram")


@pytest.mark.django_db(transaction=True)
def test_too_large_and_pinned_say_why(gpu24):
    vllm_engine()
    a = deployment("a", pinned=True)
    big = deployment("big", gib=30)
    b = deployment("b")
    with pytest.raises(operations.NoCapacityError, match=r"largest GPU pool holds 24\.0 GiB"):
        operations.ensure_ready(big.pk)
    operations.ensure_ready(a.pk)
    with pytest.raises(operations.NoCapacityError, match=r"in the way: a \(pinned\)") as info:
        operations.ensure_ready(b.pk)
    assert info.value.code == "no_capacity"
    assert state("a") == ("ready", "")
    assert state("b") == ("stopped", "")
    assert entries("b") == {}


@pytest.mark.django_db(transaction=True)
def test_a_stopped_model_is_refused_until_started(gpu24):
    vllm_engine()
    a = deployment("a")
    operations.ensure_ready(a.pk)
    operations.stop(a.pk)
    assert state("a") == ("stopped", "")
    assert entries("a") == {}
    assert gpu24.devices()[0].used_bytes == 0
    with pytest.raises(operations.ModelStoppedError):
        operations.ensure_ready(a.pk)
    operations.start(a.pk)
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_many_concurrent_requests_cause_one_wake(gpu24):
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    operations.ensure_ready(a.pk)
    operations.ensure_ready(b.pk)  # a is parked now
    errors = []

    def request_a():
        try:
            operations.ensure_ready(a.pk)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=request_a) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert state("a") == ("ready", "")
    assert Event.objects.filter(kind="deployment.woke", subject="a").count() == 1


@pytest.mark.django_db(transaction=True)
def test_on_unified_memory_the_park_is_deep(tmp_path, settings):
    driver = make_host(tmp_path, settings, SimSpec(unified=True, sizes=[40 * GIB]))
    settings.CAPYCTL = {**settings.CAPYCTL, "RAM_RESERVE_BYTES": 0}
    try:
        vllm_engine()
        a, b = deployment("a", gib=24), deployment("b", gib=24)
        operations.ensure_ready(a.pk)
        operations.ensure_ready(b.pk)
        assert state("a") == ("parked", "deep")
        assert "unified" in entries("a")
        assert overcommitted(Host.objects.get(name="local")) == []
    finally:
        driver.stop_all(grace_seconds=2)
        set_local_driver(None)


@pytest.mark.django_db(transaction=True)
def test_the_celery_tasks_run_the_same_operations_in_process(gpu24):
    from capyctl.scheduler import tasks

    vllm_engine()
    a = deployment("a")
    tasks.ensure_ready.delay(a.pk)  # standalone: eager, in this process
    assert state("a") == ("ready", "")
    tasks.poll_hosts.delay()  # polls remote hosts (none), reconciles the online ones
    assert state("a") == ("ready", "")  # nothing to change while the engine runs
    # The engine dies: the next poll's reconcile finds it gone, fails a, frees its memory.
    engine = gpu24.instance(operations.instance_key(a.instances.get())).process
    assert engine.popen is not None
    engine.popen.kill()
    engine.wait(timeout=10)
    tasks.poll_hosts.delay()
    assert state("a")[0] == "failed"
    assert "its engine exited with status -9" in Deployment.objects.get(pk=a.pk).state_reason
    assert entries("a") == {}
