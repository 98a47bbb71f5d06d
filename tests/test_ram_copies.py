"""The weights copy a ``ram`` park keeps in host RAM, as the ledger promises it.

A park promises host RAM for its copy before the engine makes it: the larger of the size
declared for the model and the copy a park of it was last measured at (DESIGN §12).
"""

import time

import pytest

from capyctl.deployments.models import Deployment
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import overcommitted
from capyctl.scheduler import actions
from tests.scheduling import GIB, MIB, SIM, deployment, state

# Simulated vLLM whose weights, the copy a ram park makes, are 2 GiB (a quarter of the
# scenario of 8 GiB copies: host RAM is the test machine's own, shared with other work).
REAL_COPY_ENV = {"CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB", "CAPYCTL_SIM_WEIGHTS_BYTES": "2GiB"}


def _leave_host_ram(free: int) -> None:
    """Set the local host's RAM reserve so that ``free`` bytes of its RAM pool are free."""
    host = Host.objects.get(name="local")
    ram = next(p for p in pool_usage(host) if p.pool == "ram")
    reserve = ram.reserve_bytes + ram.free_bytes - free
    Host.objects.filter(pk=host.pk).update(ram_reserve_bytes=reserve)


@pytest.mark.django_db(transaction=True)
def test_a_model_declared_smaller_than_its_copy_overshoots_host_ram_once(gpu24, settings):
    """Two 16 GiB models declared with a weights size of half their real copy (1 GiB of
    2 GiB) take turns on one 24 GiB GPU for 20 s, with two more models' copies parked in
    host RAM. Each park promised the declared size although the model's last park had
    measured its copy, so every park of it overshot host RAM (``ledger.overshoot``, the
    reserve absorbing the rest). Only the first park, with nothing measured yet, may
    overshoot now; the ones after it promise the measured copy (and park deep where it
    does not fit)."""
    settings.CAPYCTL = {**settings.CAPYCTL, "RAM_RESERVE_BYTES": 0}  # room for both copies
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=REAL_COPY_ENV)
    c = deployment("c", weights_bytes=GIB)
    d = deployment("d", weights_bytes=GIB)
    p, q = deployment("p"), deployment("q")
    for model in (d, p, q, c):  # d's copy is measured by a park with host RAM to spare
        actions.ensure_ready(model.pk)
    assert [state(m) for m in "dpq"] == [("parked", "ram")] * 3
    assert Deployment.objects.get(name="d").measured_weights_bytes is not None
    _leave_host_ram(GIB + 200 * MIB)  # room for c's declared copy, not for its real one

    deadline = time.monotonic() + 20
    rounds = 0
    while time.monotonic() < deadline or rounds < 4:
        actions.ensure_ready(d.pk)
        actions.ensure_ready(c.pk)
        rounds += 1
        assert overcommitted(Host.objects.get(name="local")) == []

    # An engine's own memory moves by a page or so between two parks (d's once read 4 KiB
    # over its promise): only a copy's misjudgement (hundreds of MiB) is looked for here.
    overshoots = [
        e for e in Event.objects.filter(kind="ledger.overshoot") if e.data["bytes"] > 64 * MIB
    ]
    assert [e.subject for e in overshoots] == ["c"], [e.message for e in overshoots]
    assert overshoots[0].data == {"pool": "ram", "bytes": overshoots[0].data["bytes"]}
    first_park = Event.objects.filter(kind="deployment.parked", subject="c").earliest("pk")
    assert overshoots[0].pk < first_park.pk  # measured by c's first park, none after
    copies = Deployment.objects.filter(name__in=["c", "d"]).values_list(
        "measured_weights_bytes", flat=True
    )
    assert all(abs((copy or 0) - 2 * GIB) < 64 * MIB for copy in copies), list(copies)
    assert Event.objects.filter(kind="deployment.parked", subject="c").count() > 3


@pytest.mark.django_db
def test_the_listing_shows_the_copy_measured_against_declared(cli, gpu24):
    """``deployment list`` says what a park promises for each model's copy, measured
    against declared; ``--json`` (and REST, the same report) adds the figure promised."""
    import json

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=REAL_COPY_ENV)
    deployment("both", weights_bytes=GIB)
    deployment("declared", weights_bytes=GIB)
    deployment("measured")
    deployment("unknown")
    Deployment.objects.filter(name__in=["both", "measured"]).update(measured_weights_bytes=2 * GIB)
    listing = cli("deployment", "list")
    assert listing.code == 0, listing.err
    rows = {line.split()[0]: line for line in listing.out.splitlines()}
    assert "RAM COPY" in rows["NAME"]
    assert "2.0 GiB measured (1.0 GiB declared)" in rows["both"]
    assert "1.0 GiB declared" in rows["declared"]
    assert "2.0 GiB measured " in rows["measured"]
    assert " - " in rows["unknown"].split("16.0 GiB", 1)[1]
    data = {d["name"]: d for d in json.loads(cli("deployment", "list", "--json").out)}
    assert [data[n]["weights_copy_bytes"] for n in ("both", "declared", "measured", "unknown")] == [
        2 * GIB,
        GIB,
        2 * GIB,
        None,
    ]
