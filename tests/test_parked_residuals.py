"""Parked models' residuals on one GPU: what each leaves there (its CUDA context, graphs)
adds up, and once parking the ready model no longer frees enough for another, the least
recently used parked models are stopped to make room (DESIGN §5)."""

import re
from dataclasses import replace

import pytest

from capyctl.deployments.models import Deployment
from capyctl.deployments.services import get_deployment, spec_of, update_deployment
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.services import overcommitted
from capyctl.scheduler import actions
from tests.scheduling import MIB, SIM, SIM_ENV, deployment, entries, state

RESIDUAL = "1638MiB"  # about 1.6 GiB left on the GPU by each parked engine


@pytest.mark.django_db(transaction=True)
def test_parked_residuals_are_stopped_to_make_room_for_a_start(gpu24):
    """Seven 16 GiB models on a 24 GiB GPU, each leaving 1.6 GiB when parked: after five
    parks and a sixth model ready, parking the sixth frees 14.4 GiB, and 5 x 1.6 GiB of
    residuals leave 1.6 GiB short of the seventh's 16 GiB. It waited for room until its
    wake timeout (what was in the way: the parked models, which never leave). The least
    recently used parked model is now stopped as well, and the event says why."""
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm",
               env={**SIM_ENV, "CAPYCTL_SIM_RESIDUAL_BYTES": RESIDUAL})  # fmt: skip
    names = [f"ft-{i:02}" for i in range(7)]
    models = {name: deployment(name, wake_timeout_seconds=2) for name in names}
    for name in names[:6]:
        actions.ensure_ready(models[name].pk)
    assert [state(n)[0] for n in names[:6]] == ["parked"] * 5 + ["ready"]

    actions.ensure_ready(models["ft-06"].pk, timeout=2)
    assert state("ft-06") == ("ready", "")
    assert state("ft-05")[0] == "parked"
    assert state("ft-00") == ("stopped", "")  # the least recently used; one is enough
    assert entries("ft-00") == {}
    assert [state(n)[0] for n in names[1:5]] == ["parked"] * 4
    stopped = Event.objects.get(kind="deployment.stopped", subject="ft-00")
    assert re.fullmatch(
        r"stopped ft-00 \(parked\) to make room for ft-06: its parked residual "
        r"\(1\.6 GiB on gpu0\) is needed: parking alone is not enough",
        stopped.message,
    ), stopped.message
    assert overcommitted(Host.objects.get(name="local")) == []


@pytest.mark.django_db(transaction=True)
def test_a_wake_stops_a_parked_model_when_parking_the_ready_ones_is_not_enough(gpu24):
    """Engines that leave 3 GiB each when parked: ``a`` (16 GiB) and ``b`` (16 GiB) parked,
    ``x`` and ``y`` (8 GiB each) ready, 22 of 24 GiB held. Waking ``a`` needs 13 GiB beside
    its own residual; parking ``x`` and ``y`` frees 10: ``b``'s residual is in the way, and
    ``b`` is stopped (the wake never stops ``a`` itself)."""
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm",
               env={**SIM_ENV, "CAPYCTL_SIM_RESIDUAL_BYTES": "3GiB"})  # fmt: skip
    models = {name: deployment(name, gib=16 if name in "ab" else 8, wake_timeout_seconds=2)
              for name in ("a", "b", "x", "y")}  # fmt: skip
    for name in ("a", "b", "x", "y"):
        actions.ensure_ready(models[name].pk)
    assert [state(n)[0] for n in ("a", "b", "x", "y")] == ["parked", "parked", "ready", "ready"]

    actions.ensure_ready(models["a"].pk, timeout=2)
    assert state("a") == ("ready", "")
    assert [state(n)[0] for n in ("b", "x", "y")] == ["stopped", "parked", "parked"]
    stopped = Event.objects.get(kind="deployment.stopped", subject="b")
    assert stopped.message == (
        "stopped b (parked) to make room for a: its parked residual (3.0 GiB on gpu0) is "
        "needed: parking alone is not enough"
    )
    assert overcommitted(Host.objects.get(name="local")) == []


@pytest.mark.django_db(transaction=True)
def test_a_model_parked_before_is_parked_again_on_what_its_park_left(gpu24):
    """Two 22 GiB models on a 24 GiB GPU whose engines leave 512 MiB when parked. Waking
    ``b`` needs 21.5 GiB beside its residual. Parking ``a`` was counted on the policy's
    guess of what it would leave (a tenth of its claim, 2.2 GiB): 0.2 GiB short, so ``a``
    was stopped instead and would start cold on its next request. ``a`` was parked
    before: what that park left is remembered and counted on, and ``a`` is parked."""
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    a, b = deployment("a", gib=22), deployment("b", gib=22)
    actions.ensure_ready(a.pk)
    actions.park(a.pk)
    actions.ensure_ready(b.pk)  # beside a's residual
    actions.park(b.pk)
    actions.ensure_ready(a.pk)
    assert Deployment.objects.get(pk=a.pk).measured_residual_bytes == 512 * MIB

    actions.ensure_ready(b.pk, timeout=5)
    assert state("b") == ("ready", "")
    assert state("a")[0] == "parked"
    assert not Event.objects.filter(kind="deployment.stopped").exists()
    assert overcommitted(Host.objects.get(name="local")) == []

    # Launched otherwise from its next start, it may leave something else: forgotten.
    update_deployment("a", replace(spec_of(get_deployment("a")), engine_args=["--enforce-eager"]))
    assert Deployment.objects.get(pk=a.pk).measured_residual_bytes is None


@pytest.mark.django_db(transaction=True)
def test_what_a_replicas_park_left_is_counted_on_for_its_siblings(gpu24):
    """The same weights on the same engine: a replica's park measures what its siblings'
    parks will leave too, as its weights copy sizes their first ram parks."""
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    chat = deployment("chat", gib=8, replicas=2)
    actions.ensure_ready(chat.pk)
    actions.park(chat.pk)
    left = dict(Deployment.objects.values_list("name", "measured_residual_bytes"))
    assert left == {"chat": 512 * MIB, "chat~1": 512 * MIB}
