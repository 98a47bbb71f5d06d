"""Draining a host (docs/replicas.md): nothing new is placed there, and what runs there
moves to the other hosts, its requests in flight finishing first.

Two hosts in this process: the local one, and ``gpu2``, another host's agent stood in for
by a second in-process driver of simulated GPUs (the mutual-TLS calls are the boundary
replaced; tests/test_hosts_join.py drives real agents)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.utils import timezone

from capyctl.deployments.models import Deployment
from capyctl.engines.services import add_engine
from capyctl.errors import UserError
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.scheduler import (
    drivers,
    host_drains,
    remote_hosts,
    replica_scaling,
    requests_in_progress,
)
from capyctl.scheduler.drivers import LocalHostDriver, set_local_driver
from capyctl.scheduler.errors import NoCapacityError
from capyctl.scheduler.host_states import drain_host, undrain_host
from hostagent.probe import SimulatedProbe
from hostagent.simgpu import SimSpec
from tests.scheduling import GIB, SIM, SIM_ENV, deployment, make_host


@pytest.fixture
def two_hosts(tmp_path, settings, monkeypatch):
    """``local`` and ``gpu2``, each with two simulated 24 GiB GPUs."""
    spec = SimSpec(unified=False, sizes=[24 * GIB, 24 * GIB])
    local = make_host(tmp_path / "local", settings, spec)
    probe = SimulatedProbe(spec, tmp_path / "gpu2" / "sim")
    other = LocalHostDriver(probe, tmp_path / "gpu2" / "logs")
    Host.objects.create(
        name="gpu2", address="127.0.0.1:7443", is_local=False, state=Host.State.UNKNOWN,
        enrolled_at=timezone.now(), cert_fingerprint="ab" * 32,
    )  # fmt: skip
    inventory = probe.inventory().as_dict()
    monkeypatch.setattr(remote_hosts, "agent_call", lambda host, method, path: dict(inventory))
    monkeypatch.setattr(drivers, "RemoteHostDriver", lambda host: other)
    remote_hosts.poll_hosts()
    assert Host.objects.get(name="gpu2").state == Host.State.ONLINE
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    yield
    local.stop_all(grace_seconds=2)
    other.stop_all(grace_seconds=2)
    set_local_driver(None)


def _where(name: str) -> tuple[str, str]:
    row = Deployment.objects.select_related("host").get(name=name)
    return (row.host.name if row.host else "-"), row.observed_state


def _run_now(function: Any) -> Any:
    def run(deployment_id: int) -> None:
        function(deployment_id)

    return run


@pytest.mark.django_db(transaction=True)
def test_a_drain_moves_replicas_and_a_lone_model_after_their_requests_finish(two_hosts):
    """``chat`` (two replicas, one on each host) and ``solo`` on gpu2: draining gpu2 stops
    chat's replica there only once its request in flight has ended, while the other
    replica serves; the replicas' pass brings it up again on the local host; solo is
    stopped and started on the local host at once. Nothing new goes to the drained host;
    it says when it is drained, and takes models again once undrained."""
    from capyctl.scheduler import actions

    chat = deployment("chat", replicas=2)
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(chat.pk)
    actions.ensure_ready(second.pk)
    solo = deployment("solo", gib=6)
    actions.ensure_ready(solo.pk)
    assert {_where("chat")[0], _where("chat~1")[0]} == {"local", "gpu2"}  # spread over hosts
    drained_row = chat if _where("chat")[0] == "gpu2" else second
    assert _where("solo") == ("gpu2", "ready")  # hosts are tried in name order

    drain_host("gpu2", actor="test")
    assert requests_in_progress.begin(drained_row.pk)  # a request it is still answering
    mover = threading.Thread(target=host_drains.move, args=(drained_row.pk,))
    mover.start()
    time.sleep(1.0)
    assert _where(drained_row.name) == ("gpu2", "draining")  # waits for its request
    requests_in_progress.end(drained_row.pk)
    mover.join(timeout=30)
    assert _where(drained_row.name)[1] == "stopped"
    stopped = Event.objects.filter(kind="deployment.stopped", deployment_id=drained_row.pk)
    assert "its host gpu2 is draining: moved to another host" in str(stopped[0].message)

    replica_scaling.scale(Deployment.objects.get(pk=chat.pk), _run_now(actions.ensure_ready))
    assert _where(drained_row.name) == ("local", "ready")  # kept up: started here

    host_drains.drain_all(_run_now(host_drains.move))  # solo moves
    assert _where("solo") == ("local", "ready")
    host_drains.drain_all(_run_now(host_drains.move))
    drained = Event.objects.filter(kind="host.drained")
    assert [e.message for e in drained] == ["host gpu2 is drained: nothing runs on it"]
    host_drains.drain_all(_run_now(host_drains.move))
    assert drained.count() == 1  # said once

    # Nothing new goes there: a new model is placed on the local host (gpu2 comes first in
    # name order); a model whose host was chosen cannot start while it drains.
    fresh = deployment("fresh", gib=1)
    actions.ensure_ready(fresh.pk)
    assert _where("fresh") == ("local", "ready")
    pinned = deployment("pinned", gib=6, host="gpu2")
    with pytest.raises(NoCapacityError, match="its host gpu2 is draining"):
        actions.ensure_ready(pinned.pk)
    undrain_host("gpu2", actor="test")
    actions.ensure_ready(pinned.pk)
    assert _where("pinned") == ("gpu2", "ready")


@pytest.mark.django_db
def test_drain_and_undrain_from_the_command_line(cli, two_hosts):
    out = cli("host", "drain", "gpu2").out
    assert out.startswith("host gpu2 is draining: nothing new is placed on it")
    listed = cli("host", "list").out
    assert "online (draining)" in listed
    assert cli("host", "drain", "gpu2").code == 0  # again: nothing changes
    assert Event.objects.filter(kind="host.draining").count() == 1
    assert cli("host", "undrain", "gpu2").out == "host gpu2 takes models again\n"
    assert "draining" not in cli("host", "list").out
    missing = cli("host", "drain", "nope")
    assert missing.code != 0
    assert missing.err.count("\n") == 1, missing.err


def test_drain_refuses_an_unknown_host(db):
    with pytest.raises(UserError):
        drain_host("nope")


@pytest.mark.django_db(transaction=True)
def test_a_model_no_other_host_has_room_for_stays_and_serves(two_hosts):
    """The local host's GPUs are held by pinned models: `solo` on gpu2 has nowhere to go,
    so the drain leaves it serving there and says so once, trying again each pass."""
    from capyctl.scheduler import actions

    solo = deployment("solo", gib=20)
    actions.ensure_ready(solo.pk)
    assert _where("solo") == ("gpu2", "ready")
    for name in ("keep-0", "keep-1"):
        kept = deployment(name, gib=20, host="local", pinned=True)
        actions.ensure_ready(kept.pk)
    drain_host("gpu2", actor="test")
    host_drains.move(solo.pk)
    host_drains.move(solo.pk)
    assert _where("solo") == ("gpu2", "ready")
    (said,) = Event.objects.filter(kind="deployment.waiting", subject="solo")
    assert said.message == (
        "solo stays on gpu2, which is draining: no other host has room for it now (tried "
        "again every few seconds)"
    )


@pytest.mark.django_db(transaction=True)
def test_a_drain_moves_one_replica_of_a_model_at_a_time(two_hosts):
    """Both replicas of ``chat`` on gpu2 (``--spread gpus``): a pass sends one of them to
    move; the other serves until that one is done. Naming back the host a model was
    placed on does not make it chosen."""
    from dataclasses import replace

    from capyctl.deployments.services import get_deployment, spec_of, update_deployment
    from capyctl.scheduler import actions

    chat = deployment("chat", replicas=2, spread="gpus")
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(chat.pk)
    actions.ensure_ready(second.pk)
    assert (_where("chat"), _where("chat~1")) == (("gpu2", "ready"), ("gpu2", "ready"))
    named = replace(spec_of(get_deployment("chat")), host="gpu2", priority=3)
    assert update_deployment("chat", named).host_chosen is False
    drain_host("gpu2", actor="test")
    sent: list[int] = []
    host_drains.drain_all(sent.append)
    assert sent == [chat.pk]
