"""``capyctl simulate`` replays a model of several replicas: an engine each, on GPUs of its
own, requests routed among the ready ones and replicas brought up and parked by the
scheduler's own scaling decision; an engine serves ``max_concurrency`` requests at once,
so that a saturated engine queues and one more replica helps (docs/what-if.md)."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from typing import Any

import pytest

from capyctl.errors import UserError
from capyctl.scheduler import routing, scaling
from capyctl.whatif import report, scenario
from capyctl.whatif.engine import replay
from capyctl.whatif.model import GIB, Request, Scenario, SimHost, SimModel, Timings
from capyctl.whatif.outcome import Outcome
from tests.test_whatif import FAST, _status

TIMINGS = {**FAST, "start": 2.0}


def _chat(**extra: Any) -> SimModel:
    """A 16 GiB model whose engine serves two requests at once."""
    settings: dict[str, Any] = {"min_ready_seconds": 0, "max_turn_seconds": 5,
                                "max_concurrency": 2, "timings": Timings(**TIMINGS)}  # fmt: skip
    settings.update(extra)
    return SimModel("chat", **settings)


def _gpus(count: int, *models: SimModel, size: int = 24 * GIB) -> Scenario:
    return Scenario([SimHost("h1", [size] * count, 256 * GIB)], list(models))


def _steady(per_second: float = 4.0, seconds: float = 60.0, service: float = 1.0):
    """Requests of ``service`` seconds at an even rate: at 4 a second, twice what one
    engine of two at once serves."""
    count = int(per_second * seconds)
    return [Request(i / per_second, "chat", service) for i in range(count)]


def _figures(outcome: Outcome) -> dict[str, Any]:
    figures: dict[str, Any] = report.summary(outcome)["models"]["chat"]
    return figures


def _gpus_held(outcome: Outcome) -> set[tuple[str, str]]:
    return {(h.host, h.pool) for h in outcome.holds if h.model == "chat"}


# -- the replay -------------------------------------------------------------------------------


def test_a_saturated_engine_queues_and_more_replicas_cut_the_waits() -> None:
    requests = _steady()
    alone = _figures(replay(_gpus(3, _chat()), requests))
    outcome = replay(_gpus(3, _chat(replicas=3, min_replicas=1)), requests)
    scaled = _figures(outcome)
    assert alone["served"] == scaled["served"] == len(requests)
    # one engine: a queue that grows for the whole minute
    assert alone["wait_p50_seconds"] > 20
    assert alone["wait_p99_seconds"] > 50
    assert scaled["wait_p50_seconds"] < 1
    assert scaled["wait_p99_seconds"] < alone["wait_p99_seconds"] / 5
    assert scaled["replicas"] == {
        "minimum": 1,
        "maximum": 3,
        "peak_up": 3,
        "scaled_up": {"wake": 0, "start": 2},
        "scaled_down": 0,
        "scale_ups_not_done": 0,
    }
    assert scaled["switches"]["start"] == 3  # the first, and two scale-ups
    assert len(_gpus_held(outcome)) == 3  # each replica on a GPU of its own
    first, second = outcome.scaled
    assert [(s.replica, s.action) for s in (first, second)] == [
        ("chat~1", "start"),
        ("chat~2", "start"),
    ]
    assert "over target_concurrency 8" in first.reason  # scaling.decide's own words


def test_unlimited_engines_replay_as_before() -> None:
    """With no max_concurrency an engine takes every request at once, as before: nothing
    waits but for the start."""
    outcome = replay(_gpus(1, _chat(max_concurrency=0)), _steady())
    waits = [r.waited for r in outcome.requests]
    assert max(waits) == pytest.approx(TIMINGS["start"])
    assert sum(1 for w in waits if w > 0) == 8  # those that came while it started


def test_fixed_replicas_keep_every_one_up_and_share_the_requests() -> None:
    requests = [Request(i * 0.5, "chat", 0.2) for i in range(120)]  # light: no scaling by load
    outcome = replay(_gpus(2, _chat(replicas=2, idle_park_seconds=5)), requests)
    figures = _figures(outcome)
    assert figures["replicas"]["minimum"] == figures["replicas"]["maximum"] == 2
    assert figures["replicas"]["peak_up"] == 2
    assert figures["replicas"]["scaled_up"]["start"] == 1  # kept up: the second follows
    assert figures["replicas"]["scaled_down"] == 0  # neither is past the minimum
    assert Counter(s.label for s in outcome.switches) == {"start": 2}
    assert len(_gpus_held(outcome)) == 2
    served_by = Counter(r.replica for r in outcome.requests if r.at > 5)
    assert served_by.keys() == {"chat", "chat~1"}  # tied at 0 in flight: each in turn
    assert abs(served_by["chat"] - served_by["chat~1"]) <= 1


def test_a_replica_never_shares_a_gpu_with_another() -> None:
    """One GPU with room for three models of 16 GiB: still one replica (the sibling rule),
    and the scale-ups it calls for find no room."""
    outcome = replay(_gpus(1, _chat(replicas=3, min_replicas=1), size=80 * GIB), _steady())
    figures = _figures(outcome)
    assert figures["served"] == len(outcome.requests)
    assert figures["replicas"]["peak_up"] == 1
    assert figures["replicas"]["scaled_up"] == {"wake": 0, "start": 0}
    assert figures["replicas"]["scale_ups_not_done"] > 0
    assert _gpus_held(outcome) == {("h1", "gpu0")}


def test_idle_replicas_past_the_minimum_are_parked_and_woken_again() -> None:
    """A burst brings replicas up; while one long request keeps one of them busy, the
    others go idle and are parked, the most recently started first; the next burst wakes
    the one parked last first."""
    burst = _steady(seconds=20)
    long_one = Request(25.0, "chat", 60.0)
    again = [Request(60 + r.at, "chat", r.service) for r in burst]
    model = _chat(replicas=3, min_replicas=1, idle_park_seconds=10)
    outcome = replay(_gpus(3, model), [*burst, long_one, *again])
    steps = [(s.action, s.replica) for s in outcome.scaled if s.done]
    assert steps[:2] == [("start", "chat~1"), ("start", "chat~2")]
    busy = outcome.requests[len(burst)].replica  # the long request's replica
    idle = [name for name in ("chat~2", "chat~1", "chat") if name != busy]  # last started first
    assert steps[2:4] == [("park", idle[0]), ("park", idle[1])]
    assert steps[4] == ("wake", idle[1])  # parked last: its copy the warmest
    figures = _figures(outcome)
    assert figures["replicas"]["scaled_down"] == 2
    assert figures["switches"]["park ram"] == 2
    assert figures["switches"]["wake ram"] == figures["replicas"]["scaled_up"]["wake"] >= 1
    assert all(r.status == 200 for r in outcome.requests)


def test_a_request_waiting_past_scale_up_wait_seconds_brings_one_up() -> None:
    """With target_concurrency out of reach, only a wait calls for one more: the sooner
    the shorter its scale_up_wait_seconds."""

    def p99(wait: float) -> float:
        model = _chat(replicas=2, min_replicas=1, target_concurrency=1000,
                      scale_up_wait_seconds=wait)  # fmt: skip
        outcome = replay(_gpus(2, model), _steady(per_second=3))
        (step,) = outcome.scaled
        assert f"over scale_up_wait_seconds {wait} s" in step.reason
        return float(_figures(outcome)["wait_p99_seconds"])

    assert p99(3) < p99(15) - 5


def test_the_steps_are_the_scaling_decisions_own(monkeypatch) -> None:
    """Nothing of the decision is re-implemented: a decision that never scales leaves one
    replica up, and the routing's pick is the one requests go to."""
    requests = _steady()
    monkeypatch.setattr(scaling, "decide", lambda replicas, demand, bounds: None)
    outcome = replay(_gpus(3, _chat(replicas=3, min_replicas=1)), requests)
    assert outcome.scaled == []
    assert _figures(outcome)["replicas"]["peak_up"] == 1
    monkeypatch.undo()
    picks: list[int] = []

    def highest(loads, key=None, **extra):
        picks.append(max(loads))
        return max(loads)

    monkeypatch.setattr(routing, "choose", highest)
    requests = [Request(i * 0.5, "chat", 0.2) for i in range(40)]
    outcome = replay(_gpus(2, _chat(replicas=2)), requests)
    assert picks
    assert {r.replica for r in outcome.requests if r.at > 5} == {"chat~1"}  # the highest id


@pytest.mark.parametrize("seed", [1, 2])
def test_passing_over_unchanged_models_never_changes_an_answer(seed: int, monkeypatch) -> None:
    """The scheduler's pass skips a model of several replicas that has not changed since
    it found nothing to do; asking at every pass (as the server does) gives the same
    replay. The routing's turn among tied replicas starts afresh for each."""
    rng = random.Random(seed)  # noqa: S311 - a seeded trace, not a secret
    models = [
        _chat(replicas=3, min_replicas=1, idle_park_seconds=6, target_concurrency=2),
        _chat(replicas=2, idle_park_seconds=15, max_concurrency=1, claim_bytes=8 * GIB),
        _chat(replicas=2, min_replicas=1, max_concurrency=4),
    ]
    for i, model in enumerate(models):
        model.name = f"m{i}"
    hosts = [SimHost("h1", [24 * GIB] * 3, 64 * GIB), SimHost("h2", [24 * GIB] * 2, 64 * GIB)]
    requests, at = [], 0.0
    for _ in range(500):
        at += rng.expovariate(rng.choice([0.5, 6.0]))
        requests.append(Request(at, rng.choice(models).name, rng.uniform(0.2, 3.0)))
    runs = []
    for every_try in (False, True):
        monkeypatch.setattr(routing, "_turn", itertools.count())
        runs.append(replay(Scenario(hosts, models), requests, every_try=every_try))
    fast, every = runs
    assert {s.action for s in fast.scaled if s.done} == {"start", "wake", "park"}
    assert [(round(s.at, 6), s.replica, s.action, s.done) for s in fast.scaled] == [
        (round(s.at, 6), s.replica, s.action, s.done) for s in every.scaled
    ]
    assert [(r.status, r.replica, round(r.waited, 6)) for r in fast.requests] == [
        (r.status, r.replica, round(r.waited, 6)) for r in every.requests
    ]


# -- scenarios and the command -------------------------------------------------------------------


def test_replicas_are_set_as_the_cli_takes_them(db) -> None:
    data = _status()
    ranged = scenario.build(scenario.apply_sets(data, ["chat.replicas=1:3"])).models[0]
    assert (ranged.replicas, ranged.min_replicas, ranged.kept_up) == (3, 1, 1)
    fixed = scenario.build(scenario.apply_sets(data, ["chat.replicas=2"])).models[0]
    assert (fixed.replicas, fixed.min_replicas, fixed.kept_up) == (2, 0, 2)
    sets = ["chat.target_concurrency=3", "chat.scale_up_wait_seconds=7",
            "chat.max_concurrency=4", "chat.spread=gpus"]  # fmt: skip
    model = scenario.build(scenario.apply_sets(data, sets)).models[0]
    assert (model.target_concurrency, model.scale_up_wait_seconds) == (3, 7)
    assert (model.max_concurrency, model.spread) == (4, "gpus")
    plain = scenario.build(data).models[0]
    assert (plain.replicas, plain.max_concurrency) == (1, 0)  # one engine, no limit
    for bad, says in [
        ("chat.replicas=3:1", "3 is more than 1"),
        ("chat.replicas=0", "replicas are 1 to 64, not 0"),
        ("chat.replicas=1:65", "replicas are 1 to 64, not 65"),
        ("chat.replicas=abc", "replicas is N or MIN:MAX"),
        ("chat.replicas=", "replicas is N or MIN:MAX"),
        ("chat.target_concurrency=0", "not a whole number of 1 or more"),
        ("chat.scale_up_wait_seconds=soon", "not a whole number of 1 or more"),
        ("chat.max_concurrency=-1", "not a count value"),
        ("chat.spread=racks", "spread is one of hosts, gpus"),
    ]:
        with pytest.raises(UserError, match=says) as refused:
            scenario.apply_sets(data, [bad])
        assert "\n" not in str(refused.value)


def test_a_warm_scenario_has_its_replicas_where_the_ledger_has_them(db) -> None:
    data = _status(replicas=3, min_replicas=1)
    data["hosts"][0]["pools"].insert(1, {"pool": "gpu1", "capacity_bytes": 24 * GIB,
                                         "foreign_bytes": 0})  # fmt: skip
    data["deployments"][0]["replica_set"] = [
        {"index": 0, "name": "chat", "host": "local", "observed_state": "ready"},
        {"index": 1, "name": "chat~1", "host": "local", "observed_state": "ready"},
        {"index": 2, "name": "chat~2", "host": None, "observed_state": "stopped"},
    ]
    data["ledger"].append({"host": "local", "pool": "gpu1", "deployment": "chat~1",
                           "bytes": 16 * GIB})  # fmt: skip
    built = scenario.build(data, warm=True)
    first_replicas = built.models[0].replica_set
    assert [(r.host, r.state, r.pools) for r in first_replicas] == [
        ("local", "ready", ["gpu1"]),
        (None, "stopped", []),
    ]
    outcome = replay(built, [Request(i * 0.5, "chat", 0.2) for i in range(10)])
    assert outcome.switches == []  # both were ready: nothing started
    served_on = Counter(h.pool for h in outcome.holds if h.phase == "serve")
    assert set(served_on) == {"gpu0", "gpu1"}
    cold = scenario.build(scenario.with_hosts(data, "3x24GiB"))
    assert [(r.host, r.state) for r in cold.models[0].replica_set] == [(None, "stopped")] * 2


def test_a_replicas_measured_timings_count_as_its_deployments(db) -> None:
    from capyctl.deployments.models import Deployment
    from capyctl.events.services import record_event
    from tests.scheduling import deployment, vllm_engine

    vllm_engine()
    first = deployment("chat", replicas=2)
    other = Deployment.objects.get(replica_of=first)
    assert other.name == "chat~1"
    for row, ms in ((first, 1000), (first, 2000), (other, 3000), (other, 4000)):
        record_event("deployment.ready", "ready", deployment_id=row.pk, duration_ms=ms)
    measured = scenario.measured_timings()
    assert measured == {"chat": {"start": 2.5}}  # the median of all four


@pytest.fixture
def busy(tmp_path):
    """A scenario file of one host with three 24 GiB GPUs and ``chat``, an engine of two
    requests at once, and a trace of four requests of a second a second for a minute."""
    data = _status(max_concurrency=2, timings={"start": 2.0})
    data["hosts"] = scenario.parse_hosts("3x24GiB")
    data["deployments"][0]["host"] = None
    data["ledger"] = []
    path = tmp_path / "busy.json"
    path.write_text(json.dumps(data))
    trace = tmp_path / "busy.jsonl"
    trace.write_text("".join(json.dumps({"at": i / 4, "model": "chat", "duration_ms": 1000}) + "\n"
                             for i in range(240)))  # fmt: skip
    return path, trace


def test_simulate_answers_what_replicas_change(cli, busy) -> None:
    path, trace = busy
    done = cli("simulate", str(trace), "--scenario", str(path), "--set", "chat.replicas=1:3",
               "--compare", str(path))  # fmt: skip
    assert done.code == 0, done.err
    assert "scenario: busy -> busy with chat.replicas=1:3" in done.out
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[2:]
            for line in done.out.splitlines()[2:] if len(line.split()) > 2}  # fmt: skip
    assert rows["replicas peak"] == ["-", "->", "3"]
    assert rows["scale-up start"] == ["0", "->", "2", "-", "->", "2"]
    theirs, _, _, mine, _ = rows["wait p99"][:5]  # overall: "61.00 s -> 5.25 s"
    assert float(mine) < float(theirs) / 5
    as_json = json.loads(cli("simulate", str(trace), "--scenario", str(path), "--set",
                             "chat.replicas=2", "--json").out)  # fmt: skip
    assert as_json["models"]["chat"]["replicas"]["peak_up"] == 2
    assert as_json["overall"]["replicas"]["scaled_up"] == {"wake": 0, "start": 1}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("3:1", "--set 'chat.replicas=3:1': 3 is more than 1"),
        ("0", "--set 'chat.replicas=0': replicas are 1 to 64, not 0"),
        ("abc", "--set 'chat.replicas=abc': replicas is N or MIN:MAX, like 2 or 1:3"),
    ],
)
def test_simulate_refuses_a_bad_replicas_value_in_one_line(cli, busy, value, says) -> None:
    path, trace = busy
    done = cli("simulate", str(trace), "--scenario", str(path), "--set", f"chat.replicas={value}")
    assert done.code == 2
    assert done.err.strip() == f"capyctl: error: {says}"
    assert done.out == ""
