"""The simulator runs the server's step (:mod:`capyctl.scheduler.steps`), not a copy of it:
a change of the server's decisions changes the replay's answer with nothing in
``capyctl/whatif`` touched, and the replay follows the installation it was taken from (its
mode's busy grace, engines whose parks kept their memory)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from capyctl.events.models import Event
from capyctl.scheduler import actions, steps
from capyctl.whatif import scenario
from capyctl.whatif.engine import replay
from capyctl.whatif.model import GIB, Request, Scenario, SimHost
from capyctl.whatif.outcome import Outcome
from tests.scheduling import deployment, state, vllm_engine
from tests.test_whatif import _model


def _two_on_one_gpu(**extra: Any) -> Scenario:
    """Two 16 GiB models on one 24 GiB GPU: each request for the other is a switch."""
    return Scenario([SimHost("h1", [24 * GIB], 64 * GIB)], [_model("a"), _model("b")], **extra)


ALTERNATING = [Request(float(t), "ab"[t % 2]) for t in range(8)]


def _switches(outcome: Outcome) -> Counter[str]:
    return Counter(s.label for s in outcome.switches)


def _stop_instead_of_parking(victim_mode: str, observed: str | None) -> str | None:
    """A policy change in the server's code: an eviction stops what it would park."""
    how = _EVICT_HOW(victim_mode, observed)
    return steps.DRAIN_AND_STOP if how == steps.PARK else how


_EVICT_HOW = steps.evict_how


def test_a_change_of_the_servers_eviction_changes_the_replays_answer(monkeypatch):
    before = replay(_two_on_one_gpu(), ALTERNATING)
    # (a switch for each request after the first two starts: each ends 0.2 s after it
    # begins, so the model asked a second later finds the other idle)
    assert _switches(before) == {"start": 2, "park ram": 7, "wake ram": 6}
    assert _switches(replay(_two_on_one_gpu(), ALTERNATING, every_try=True)) == _switches(before)

    monkeypatch.setattr(steps, "evict_how", _stop_instead_of_parking)
    after = replay(_two_on_one_gpu(), ALTERNATING)
    switched = _switches(after)
    assert switched["park ram"] == switched["wake ram"] == 0  # every switch a stop and a start
    assert switched["stop"] >= 4
    assert switched["start"] == switched["stop"] + 1  # each switch after the first start
    assert [r.status for r in after.requests] == [200] * 8


@pytest.mark.django_db(transaction=True)
def test_the_same_change_changes_the_server_the_same_way(gpu24, monkeypatch):
    """The server's verbs ask the same function (simulated 24 GiB GPU, simulated engines)."""
    monkeypatch.setattr(steps, "evict_how", _stop_instead_of_parking)
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    assert state("a") == ("stopped", "")
    assert not Event.objects.filter(kind="deployment.parked").exists()
    stopped = Event.objects.get(kind="deployment.stopped", subject="a")
    assert stopped.message.startswith("stopped a instead of parking")


def test_a_change_of_the_servers_pause_changes_the_replays_waits(monkeypatch):
    """b asks while a answers: a is busy, so b's first try finds no room and pauses for
    room as the step says. A longer pause (in the server's code) is a longer wait."""
    trace = [Request(0.0, "a", service=2.0), Request(0.45, "b")]
    before = replay(_two_on_one_gpu(), trace)
    monkeypatch.setattr(steps, "ROOM_RETRY_SECONDS", 1.0)
    after = replay(_two_on_one_gpu(), trace)
    waited = [r.waited for r in before.requests], [r.waited for r in after.requests]
    assert waited[0][0] == waited[1][0] == pytest.approx(0.5)  # a's own start, unchanged
    # b's tries come at 2.55 (a busy: it answered at 2.5), then every pause: 2.8 against
    # 3.55, then a park (0.2 s) and b's start (0.5 s).
    assert waited[0][1] == pytest.approx(3.05)
    assert waited[1][1] == pytest.approx(3.8)


def test_server_modes_longer_busy_grace_is_replayed():
    """Server mode sees a request's end only through ``last_request_at``: a model stays
    busy a second longer after it (steps.busy_grace), so b, asked half a second after a's
    last answer, waits for a's turn to pass there and not in standalone."""
    trace = [Request(0.0, "a"), Request(1.0, "b")]  # a answers at 0.5 + 0.2
    standalone = replay(_two_on_one_gpu(), trace)
    server = replay(_two_on_one_gpu(server_mode=True), trace)
    # Standalone parks a at once (0.2 s) and starts b (0.5 s); server mode first waits
    # for a's busy grace to pass (0.7 + 1.1 = 1.8), then tries at its next pause.
    assert standalone.requests[1].waited == pytest.approx(0.7)
    assert server.requests[1].waited == pytest.approx(1.55)


def _data(parks: str, mode: str = "standalone") -> dict[str, Any]:
    """An installation's status, as `capyctl simulate` reads it."""
    host = {"name": "h1", "state": "online", "unified": False,
            "pools": [{"pool": "gpu0", "capacity_bytes": 24 * GIB},
                      {"pool": "ram", "capacity_bytes": 64 * GIB}]}  # fmt: skip
    models = [{"name": n, "engine": "e", "kind": "vllm", "host": "h1",
               "gpu_memory_bytes": 16 * GIB, "min_ready_seconds": 0}
              for n in ("a", "b")]  # fmt: skip
    return {"mode": mode, "hosts": [host], "engines": [{"name": "e", "parks": parks}],
            "deployments": models, "ledger": []}  # fmt: skip


def test_an_engine_whose_parks_kept_memory_is_stopped_in_the_replay_as_on_the_server():
    trusted = scenario.build(_data("yes"))
    marked = scenario.build(_data("kept memory"))
    assert [m.parks_unverified for m in marked.models] == [True, True]
    assert not trusted.server_mode
    assert scenario.build(_data("yes", mode="server")).server_mode
    trace = [Request(0.0, "a"), Request(60.0, "b")]
    assert "park ram" in _switches(replay(trusted, trace))
    assert _switches(replay(marked, trace))["stop"] == 1
    assert "park ram" not in _switches(replay(marked, trace))
