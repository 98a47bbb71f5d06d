"""A park CapyCTL did not ask for: an engine that cannot listen on a Unix socket listens on
loopback, where any local user can call its sleep route (vLLM's is not behind its key).
Reconcile notices the engine saying it sleeps while the ledger says ready, records it and
counts the model as parked; its next request wakes it. On both databases."""

import httpx
import pytest

from capyctl.deployments.models import Deployment
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.scheduler import actions
from capyctl.scheduler.reconcile import reconcile
from hostagent.kinds.tensorfold import sleep_token
from hostagent.sim.identity import NO_SOCKET_ENV
from tests.scheduling import GIB, MIB, SIM, SIM_ENV, deployment, entries, state, vllm_engine
from tests.test_scheduler_faults import sim_engine


def local_engine(gpu24, name):
    """The running engine of deployment ``name`` on the in-process host."""
    row = Deployment.objects.get(name=name).instances.get()
    instance = gpu24.instance(actions.instance_key(row))
    assert instance is not None
    return instance


def chat(instance):
    return httpx.post(
        f"http://127.0.0.1:{instance.port}/v1/completions",
        headers={"Authorization": f"Bearer {instance.api_key}"},
        json={"model": instance.request.served_name, "prompt": "hi"},
        timeout=10,
    )


@pytest.mark.django_db(transaction=True)
def test_a_vllm_park_behind_capyctls_back_is_noticed_and_counted(gpu24):
    # A vLLM build without --uds: it listens on 127.0.0.1, its sleep route open to anyone.
    sim_engine("old-vllm", **{NO_SOCKET_ENV: "1"})
    a = deployment("a", engine="old-vllm")
    actions.ensure_ready(a.pk)
    engine = local_engine(gpu24, "a")
    assert engine.socket_path is None
    assert engine.port > 0
    status, held = entries("a")["gpu0"]
    assert status == "held"
    assert held > 15 * GIB

    # A local user, with no key at all: the engine parks.
    assert httpx.post(f"http://127.0.0.1:{engine.port}/sleep", params={"level": 1}).is_success
    assert httpx.get(f"http://127.0.0.1:{engine.port}/is_sleeping").json() == {"is_sleeping": True}
    assert state("a") == ("ready", "")  # CapyCTL has not seen it yet

    host = Host.objects.get(name="local")
    reconcile(host.pk)
    assert state("a") == ("parked", "deep")
    assert "its engine says it is sleeping" in Deployment.objects.get(name="a").state_reason
    noticed = Event.objects.get(kind="deployment.parked_unasked", subject="a")
    assert noticed.level == Event.Level.WARNING
    assert "without CapyCTL" in noticed.message
    # What it holds now, measured: the GPU's claim is no longer counted as used.
    assert entries("a")["gpu0"] == ("held", 512 * MIB)

    reconcile(host.pk)  # nothing more to say
    assert Event.objects.filter(kind="deployment.parked_unasked").count() == 1

    # Its next request wakes it as after a deep park, and it answers again.
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert entries("a")["gpu0"] == ("held", held)
    assert chat(engine).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_tensorfold_sleep_behind_capyctls_back_is_noticed(gpu24):
    # TensorFold has no Unix socket: its sleep API (0.6.4 on) is on loopback, behind the
    # sleep token, which anyone who has it (here: the test) can call.
    from capyctl.engines.services import add_engine

    add_engine("tf", kind="tensorfold", command=f"{SIM} tensorfold", env=dict(SIM_ENV))
    t = deployment("t", engine="tf")
    actions.ensure_ready(t.pk)
    engine = local_engine(gpu24, "t")
    assert engine.socket_path is None
    token = sleep_token(engine.spec)
    slept = httpx.post(
        f"http://127.0.0.1:{engine.port}/sleep",
        params={"level": 2},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert slept.is_success, slept.text
    reconcile(Host.objects.get(name="local").pk)
    assert state("t") == ("parked", "deep")
    assert Event.objects.filter(kind="deployment.parked_unasked", subject="t").exists()
    actions.ensure_ready(t.pk)
    assert state("t") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_a_park_capyctl_asked_for_is_not_taken_for_one_it_did_not(gpu24):
    vllm_engine()  # tests/scheduling.py's simulated vLLM: on its socket
    a = deployment("a")
    actions.ensure_ready(a.pk)
    actions.park(a.pk, "ram")
    reconcile(Host.objects.get(name="local").pk)
    assert state("a") == ("parked", "ram")
    actions.ensure_ready(a.pk)
    reconcile(Host.objects.get(name="local").pk)
    assert state("a") == ("ready", "")
    assert not Event.objects.filter(kind="deployment.parked_unasked").exists()
