"""A park that the engine answers but whose GPU memory the probe never sees freed (vLLM
#32714: a sleep that left 16 GB a GPU) no longer blocks everyone: the model is stopped,
the switch goes on, and its engine is marked until a park of it frees memory again."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.engines.services import add_engine, update_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.scheduler import actions
from capyctl.scheduler.reconcile import reconcile
from capyctl.web.dashboard import dashboard_data
from tests.scheduling import SIM, SIM_ENV, deployment, entries, state

pytestmark = pytest.mark.database


def sim_engine(name, **env):
    return add_engine(name, kind="vllm", command=f"{SIM} vllm", env={**SIM_ENV, **env})


def messages(kind):
    return list(Event.objects.filter(kind=kind).order_by("pk").values_list("message", flat=True))


@pytest.fixture
def sticky(gpu24):
    """Engine ``sticky`` keeps its memory after a park; ``sim-vllm`` frees it. The bound
    for seeing a park's memory freed is half a second here (30 s by default)."""
    gpu24.runtime.release_timeout = 0.5
    sim_engine("sticky", CAPYCTL_SIM_KEEP_MEMORY="1")
    sim_engine("sim-vllm")
    return gpu24


@pytest.mark.django_db(transaction=True)
def test_a_park_that_keeps_its_memory_is_escalated_and_the_switch_goes_on(sticky, cli, alice):
    a = deployment("a", engine="sticky")
    b = deployment("b")
    actions.ensure_ready(a.pk)
    # b needs a's room: a's park answers, its memory stays; a is stopped, and b is served.
    # (The old code left a parked, its memory unconfirmed, and b got no_capacity.)
    actions.ensure_ready(b.pk, timeout=20)
    assert state("b") == ("ready", "")
    assert state("a") == ("stopped", "")
    assert Deployment.objects.get(name="a").desired_state == "running"  # asked for, it starts
    assert entries("a") == {}
    (parked,) = messages("deployment.parked")
    assert "parked (ram) but its memory is not confirmed released" in parked
    (marked,) = messages("engine.park_unverified")
    assert marked.startswith("engine sticky: a park did not free its GPU memory, so its models")
    stopped = messages("deployment.stopped")[-1]
    assert stopped.startswith("stopped a instead: its ram park did not free its GPU memory")
    assert "(to make room for b)" in stopped
    engine = Engine.objects.get(name="sticky")
    assert engine.park_unverified_at is not None
    assert "still sees its memory" in engine.park_unverified_reason

    # Shown where people look: the engine list, REST and the dashboard.
    listed = cli("engine", "list")
    assert listed.out.splitlines()[0].split() == [
        "NAME",
        "KIND",
        "HOST",
        "PARKS",
        "VERSION",
        "COMMAND",
    ]
    rows = {line.split()[0]: line for line in listed.out.splitlines()[1:]}
    assert "  kept memory  " in rows["sticky"]
    assert "  yes  " in rows["sim-vllm"]
    (shown,) = [e for e in json.loads(cli("engine", "list", "--json").out) if e["name"] == "sticky"]
    assert shown["parks"] == "kept memory"
    assert "still sees its memory" in shown["park_kept_memory"]["reason"]
    rest = APIClient()
    rest.force_login(alice)
    (via_rest,) = [e for e in rest.get("/api/engines/").json()["results"] if e["name"] == "sticky"]
    assert via_rest["parks"] == "kept memory"
    assert via_rest["park_kept_memory"]["next_check_after"] is not None
    board = {d["name"]: d for d in dashboard_data()["deployments"]}
    assert board["a"]["engine_parks_kept_memory"] is True
    assert board["b"]["engine_parks_kept_memory"] is False

    # The engine's next model is stopped rather than parked: no wait for a park to fail.
    c = deployment("c", engine="sticky", gib=8)
    actions.ensure_ready(c.pk)
    actions.park(c.pk)  # the best mode it allows: a stop, and it says why
    assert state("c") == ("stopped", "")
    assert len(messages("deployment.parked")) == 1  # a's, not c's
    assert messages("deployment.stopped")[-1] == (
        "stopped c: its engine's last park did not free its GPU memory, so it was stopped"
    )


@pytest.mark.django_db(transaction=True)
def test_a_park_check_at_an_idle_moment_trusts_the_engine_again(sticky):
    a = deployment("a", engine="sticky")
    b = deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk, timeout=20)  # a's park keeps its memory: a is stopped
    actions.stop(b.pk)
    host = Host.objects.get(name="local")

    def idle_and_due():
        long_ago = timezone.now() - timedelta(minutes=5)
        Deployment.objects.filter(name="a").update(
            last_request_at=long_ago, state_changed_at=long_ago
        )
        Engine.objects.filter(name="sticky").update(park_check_after=long_ago)

    # A check that fails: the park still keeps memory, a is woken again and stays marked.
    actions.ensure_ready(a.pk)
    idle_and_due()
    reconcile(host.pk)
    assert state("a") == ("ready", "")
    assert entries("a")["gpu0"][0] == "held"
    engine = Engine.objects.get(name="sticky")
    assert engine.park_unverified_at is not None
    assert engine.park_check_after is not None
    assert engine.park_check_after > timezone.now() + timedelta(minutes=29)
    reconcile(host.pk)  # not due again for half an hour
    assert len(messages("deployment.parked")) == 2

    # The engine was fixed, but a's process is the old one: only a new start shows it.
    Engine.objects.filter(name="sticky").update(env=dict(SIM_ENV))
    actions.stop(a.pk)
    actions.start(a.pk)
    idle_and_due()
    reconcile(host.pk)
    assert state("a") == ("ready", "")  # parked, freed its memory, woken again
    assert Engine.objects.get(name="sticky").park_unverified_at is None
    (trusted,) = messages("engine.park_verified")
    assert trusted == (
        "engine sticky: a ram park of a freed its GPU memory, so its models park again"
    )
    actions.park(a.pk)
    assert state("a") == ("parked", "ram")  # parks again


@pytest.mark.django_db(transaction=True)
def test_a_changed_engine_setup_is_trusted_again(sticky):
    a = deployment("a", engine="sticky")
    b = deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk, timeout=20)
    assert Engine.objects.get(name="sticky").park_unverified_at is not None
    update_engine("sticky", env=dict(SIM_ENV))  # another setup of the program
    assert Engine.objects.get(name="sticky").park_unverified_at is None
    assert messages("engine.changed")[-1] == (
        "engine sticky changed: env (its models park again: the park that kept memory was "
        "another setup's)"
    )


def test_the_bound_for_a_park_to_free_its_memory_is_a_setting(settings, tmp_path):
    from capyctl.scheduler.drivers import local_driver, set_local_driver

    assert settings.CAPYCTL["PARK_CONFIRM_SECONDS"] == 10  # it was a fixed 30 s
    settings.CAPYCTL = {**settings.CAPYCTL, "PARK_CONFIRM_SECONDS": 2.5}
    set_local_driver(None)
    try:
        assert local_driver().runtime.release_timeout == 2.5
    finally:
        set_local_driver(None)
