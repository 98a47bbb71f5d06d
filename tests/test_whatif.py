"""``capyctl simulate``: traces read and checked, scenarios and their changes, and the
replay's decisions (which come from the scheduler's own policy)."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from capyctl.errors import UserError
from capyctl.scheduler import policy
from capyctl.whatif import report, scenario
from capyctl.whatif.engine import replay
from capyctl.whatif.model import GIB, Request, Scenario, SimHost, SimModel, Timings
from capyctl.whatif.outcome import Outcome
from capyctl.whatif.trace import parse_lines

FAST = {"start": 0.5, "park_ram": 0.2, "park_deep": 0.1, "wake_ram": 0.5, "wake_deep": 0.8,
        "stop": 0.1, "service": 0.2}  # fmt: skip


def _model(name: str, **extra: Any) -> SimModel:
    settings: dict[str, Any] = {"min_ready_seconds": 0, "max_turn_seconds": 5,
                                "timings": Timings(**FAST)}  # fmt: skip
    settings.update(extra)
    return SimModel(name, **settings)


def _one_gpu(*models: SimModel, gpu: int = 24 * GIB, ram: int = 64 * GIB) -> Scenario:
    return Scenario([SimHost("h1", [gpu], ram)], list(models))


def _bursts(pattern: str, *, per: int = 5, gap: float = 3.0, spacing: float = 0.1):
    """Requests in bursts, one model a burst: ``"abab"`` is four bursts."""
    requests, at = [], 0.0
    for model in pattern:
        for _ in range(per):
            requests.append(Request(at, model))
            at += spacing
        at += gap
    return requests


def _switches(outcome: Outcome) -> Counter[str]:
    return Counter(s.label for s in outcome.switches)


# -- traces ------------------------------------------------------------------------------


def test_a_trace_needs_only_time_and_model_and_starts_at_zero() -> None:
    lines = [
        '{"at": "2026-12-02T01:00:05.500Z", "model": "b"}',
        "",
        '{"at": "2026-12-02T01:00:00Z", "model": "a", "duration_ms": 900, "queued_ms": 400}',
        '{"at": "2026-12-02T01:00:07Z", "model": "a", "status": 504, "duration_ms": 9000}',
    ]
    requests = parse_lines(lines, "t.jsonl")
    assert [(r.at, r.model) for r in requests] == [(0.0, "a"), (5.5, "b"), (7.0, "a")]
    assert requests[0].service == pytest.approx(0.5)  # its time in the engine, not its wait
    assert requests[1].service is None
    assert requests[2].service is None
    numbers = parse_lines(['{"at": 100, "model": "a"}', '{"at": 101.25, "model": "a"}'], "t")
    assert [r.at for r in numbers] == [0.0, 1.25]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "line 1: not a JSON object"),
        ("[1, 2]", "line 1: not a JSON object"),
        ('{"model": "a"}', "`at` must be an ISO-8601 time"),
        ('{"at": "yesterday", "model": "a"}', "`at` must be an ISO-8601 time"),
        ('{"at": -1, "model": "a"}', "`at` must be"),
        ('{"at": 1}', "`model` must be a model's name"),
        ('{"at": 1, "model": 7}', "`model` must be"),
    ],
)
def test_a_bad_trace_line_is_one_line_naming_it(line: str, says: str) -> None:
    with pytest.raises(UserError) as refused:
        parse_lines([line], "t.jsonl")
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(UserError, match="no requests"):
        parse_lines(["", "  "], "t.jsonl")


# -- the replay's decisions ------------------------------------------------------------------


def test_two_models_that_do_not_fit_together_switch_once_per_burst() -> None:
    outcome = replay(_one_gpu(_model("a"), _model("b")), _bursts("ababa"))
    # a starts; b starts after a parks; then each burst wakes one and parks the other.
    assert _switches(outcome) == {"start": 2, "park ram": 4, "wake ram": 3}
    assert all(r.status == 200 for r in outcome.requests)
    first_b = next(r for r in outcome.requests if r.model == "b")
    assert first_b.waited == pytest.approx(FAST["park_ram"] + FAST["start"], abs=0.06)


def test_a_model_parked_before_is_parked_again_on_what_its_park_left() -> None:
    """As the server does (tests/test_parked_residuals.py): two 22 GiB models on a 24 GiB
    GPU whose parks leave 512 MiB park and wake each other; on the policy's guess of a
    ready model's residual (2.2 GiB) the first switch stopped ``a`` instead, 0.2 GiB
    short."""
    left = 512 * 1024**2
    parked = {"host": "h1", "state": "parked", "parked_mode": "ram", "pools": ["gpu0"]}
    models = [_model(name, claim_bytes=22 * GIB, measured_residual_bytes=left, **parked)
              for name in "ab"]  # fmt: skip
    outcome = replay(_one_gpu(*models), _bursts("abab"))
    assert _switches(outcome) == {"wake ram": 4, "park ram": 3}
    assert all(r.status == 200 for r in outcome.requests)
    built = scenario.build(_status(measured_residual_bytes=left, gpu_memory_bytes=22 * GIB))
    assert built.models[0].measured_residual_bytes == left
    # A claim set otherwise is a launch the server would not have measured: forgotten.
    changed = scenario.apply_sets(_status(measured_residual_bytes=left), ["chat.gpu_memory=20GiB"])
    assert scenario.build(changed).models[0].measured_residual_bytes is None


def test_models_that_fit_together_never_switch() -> None:
    small = {"claim_bytes": 8 * GIB}
    outcome = replay(_one_gpu(_model("a", **small), _model("b", **small)), _bursts("ababab"))
    assert _switches(outcome) == {"start": 2}


def test_min_ready_seconds_keeps_a_model_and_the_others_wait() -> None:
    fast = replay(_one_gpu(_model("a"), _model("b")), _bursts("abab", gap=1.0))
    kept = replay(_one_gpu(_model("a", min_ready_seconds=60), _model("b", min_ready_seconds=60)),
                  _bursts("abab", gap=1.0))  # fmt: skip
    assert _switches(fast)["park ram"] == 3
    assert _switches(kept)["park ram"] == 1  # b waits out a's 60 s, then holds the GPU
    wait = max(r.waited for r in kept.requests)
    assert 55 < wait < 62


def test_a_model_too_large_for_any_gpu_is_refused_at_once() -> None:
    outcome = replay(_one_gpu(_model("a", claim_bytes=30 * GIB)), _bursts("a", per=3))
    assert [(r.status, r.code) for r in outcome.requests] == [(503, "no_capacity")] * 3
    assert outcome.switches == []


def test_waits_past_max_queue_seconds_are_refused_and_a_full_queue_says_so() -> None:
    busy = _model("a", max_turn_seconds=100)  # a long answer: its turn outlasts b's wait
    waiting = _model("b", max_queue_seconds=2, max_waiting=3)
    requests = [Request(0.0, "a", 50.0)] + [Request(1.0 + i * 0.01, "b") for i in range(5)]
    outcome = replay(_one_gpu(busy, waiting), requests)
    codes = Counter((r.status, r.code) for r in outcome.requests if r.model == "b")
    assert codes == {(504, "wake_timeout"): 3, (429, "queue_full"): 2}
    timed_out = [r for r in outcome.requests if r.code == "wake_timeout"]
    assert all(r.ended == pytest.approx(3.0, abs=0.3) for r in timed_out)
    pinned = replay(_one_gpu(_model("a", pinned=True), waiting), requests)
    assert {r.code for r in pinned.requests if r.model == "b"} == {"no_capacity"}  # lasting


def test_unknown_and_stopped_models_are_answered_as_the_gateway_does() -> None:
    outcome = replay(_one_gpu(_model("a", desired="stopped")),
                     [Request(0.0, "a"), Request(0.1, "nope")])  # fmt: skip
    assert [(r.status, r.code) for r in outcome.requests] == [
        (503, "model_stopped"),
        (404, "model_not_found"),
    ]


def test_an_idle_model_is_parked_after_its_idle_park_seconds() -> None:
    outcome = replay(_one_gpu(_model("a", idle_park_seconds=10)),
                     [Request(0.0, "a"), Request(30.0, "a")])  # fmt: skip
    parks = [s for s in outcome.switches if s.kind == "park"]
    assert len(parks) == 1
    assert parks[0].cause == "after 10s idle"
    assert 10 <= parks[0].at <= 10 + 2.5  # the next reconcile pass after 10 s idle
    assert _switches(outcome)["wake ram"] == 1


def test_a_busy_model_keeps_its_turn_then_gives_way() -> None:
    """While a's clients keep it busy, b waits up to a's max_turn_seconds, then a parks."""
    requests = [Request(i * 0.15, "a") for i in range(200)] + [Request(1.0, "b")]
    outcome = replay(_one_gpu(_model("a", max_turn_seconds=5), _model("b")), requests)
    b = next(r for r in outcome.requests if r.model == "b")
    assert 5.0 <= b.waited <= 5.0 + 1.5
    park = next(s for s in outcome.switches if s.kind == "park")
    assert park.model == "a"
    assert "its turn over" in park.cause


def test_the_decisions_are_the_policys_own(monkeypatch) -> None:
    """A change in production's policy changes what the replay does: nothing of it is
    re-implemented here."""
    before = _switches(replay(_one_gpu(_model("a"), _model("b")), _bursts("abab")))
    assert before["park ram"] == 3

    def stop_always(resident, host, ram_free):
        return policy.STOP, "planted: stop"

    monkeypatch.setattr(policy, "park_mode", stop_always)
    after = _switches(replay(_one_gpu(_model("a"), _model("b")), _bursts("abab")))
    assert after["park ram"] == 0
    assert after["stop"] == 3
    assert after["start"] == 4


def test_ram_parks_turn_deep_when_the_copy_does_not_fit() -> None:
    outcome = replay(_one_gpu(_model("a"), _model("b"), ram=4 * GIB), _bursts("abab"))
    assert _switches(outcome) == {"start": 2, "park deep": 3, "wake deep": 2}


def test_more_gpus_remove_the_switches() -> None:
    two = Scenario([SimHost("h1", [24 * GIB, 24 * GIB], 64 * GIB)], [_model("a"), _model("b")])
    assert _switches(replay(two, _bursts("ababab"))) == {"start": 2}


def test_a_random_day_serves_every_request_and_never_overfills_a_pool() -> None:
    rng = random.Random(5)  # noqa: S311 - a seeded trace, not a secret
    models = [_model(f"m{i}", claim_bytes=rng.choice([6, 10, 16]) * GIB) for i in range(6)]
    hosts = [SimHost("h1", [24 * GIB, 24 * GIB], 64 * GIB), SimHost("h2", [24 * GIB], 64 * GIB)]
    requests, at = [], 0.0
    for _ in range(600):
        at += rng.expovariate(4)
        requests.append(Request(at, rng.choice(models).name, rng.uniform(0.05, 0.5)))
    outcome = replay(Scenario(hosts, models), requests)
    assert all(r.status == 200 for r in outcome.requests)
    # Holds on each pool never add up to more than it has (the ledger's promise).
    claims = {m.name: m.claim_bytes for m in models}
    for key, capacity in outcome.pools.items():
        points = sorted({h.begin for h in outcome.holds if (h.host, h.pool) == key})
        for moment in points:
            held = sum(claims[h.model] for h in outcome.holds
                       if (h.host, h.pool) == key and h.begin <= moment < h.end)  # fmt: skip
            assert held <= capacity


# -- scenarios ---------------------------------------------------------------------------


def _status(**deployment: Any) -> dict[str, Any]:
    row = {"name": "chat", "kind": "vllm", "engine": "v", "host": "local", "gpus": 1,
           "gpu_memory_bytes": 16 * GIB, "weights_bytes": None, "observed_state": "ready",
           "min_ready_seconds": 10, "max_turn_seconds": 30, "max_queue_seconds": 300,
           "max_waiting": 256, "park": "auto", **deployment}  # fmt: skip
    pools = [{"pool": "gpu0", "capacity_bytes": 24 * GIB, "foreign_bytes": 0},
             {"pool": "ram", "capacity_bytes": 60 * GIB, "foreign_bytes": 0}]  # fmt: skip
    return {
        "hosts": [{"name": "local", "state": "online", "unified": False, "pools": pools}],
        "engines": [{"name": "v", "kind": "vllm", "parks": "yes"}],
        "deployments": [row],
        "ledger": [{"host": "local", "pool": "gpu0", "deployment": "chat", "bytes": 16 * GIB}],
    }


def test_a_status_file_becomes_a_scenario(db) -> None:
    built = scenario.build(_status(), warm=True)
    chat = built.models[0]
    assert (chat.claim_bytes, chat.weights_bytes) == (16 * GIB, 16 * GIB)
    assert (chat.state, chat.pools, chat.can_park_ram) == ("ready", ["gpu0"], True)
    assert chat.timings == Timings.for_kind("vllm")
    assert scenario.build(_status()).models[0].state == "stopped"  # cold, unless --warm
    fraction = scenario.build(_status(gpu_memory_bytes=None, gpu_memory_fraction=0.5))
    assert fraction.models[0].claim_bytes == 12 * GIB  # of the 24 GiB device, as a start


def test_sets_change_a_copy_and_refuse_what_they_cannot_be(db) -> None:
    data = _status()
    sets = ["chat.min_ready_seconds=30", "*.pinned=true", "chat.wake_ram_seconds=1.5",
            "chat.gpu_memory=8GiB"]  # fmt: skip
    changed = scenario.apply_sets(data, sets)
    model = scenario.build(changed).models[0]
    assert (model.min_ready_seconds, model.pinned, model.timings.wake_ram) == (30, True, 1.5)
    assert model.claim_bytes == 8 * GIB
    assert data["deployments"][0]["min_ready_seconds"] == 10  # the original is untouched
    with pytest.raises(UserError, match="model chat: no host 'elsewhere' in the scenario"):
        scenario.build(scenario.apply_sets(data, ["chat.host=elsewhere"]))
    for bad, says in [
        ("chat.min_ready_seconds", "use NAME.FIELD=VALUE"),
        ("chat.colour=red", "no field 'colour'"),
        ("nope.pinned=true", "no model 'nope'"),
        ("chat.min_ready_seconds=soon", "not a seconds value"),
        ("chat.pinned=maybe", "use true or false"),
        ("chat.park=sometimes", "park is one of"),
        ("chat.gpu_memory=lots", "invalid size"),
    ]:
        with pytest.raises(UserError, match=says):
            scenario.apply_sets(data, [bad])


def test_hosts_replace_the_hosts_and_models_go_where_they_fit(db, settings) -> None:
    settings.CAPYCTL = {**settings.CAPYCTL, "GPU_RESERVE_BYTES": 0, "RAM_RESERVE_BYTES": 0}
    built = scenario.build(scenario.with_hosts(_status(), "2x80GiB:512GiB,1x24GiB"))
    assert [(h.name, h.gpus, h.ram_bytes) for h in built.hosts] == [
        ("sim1", [80 * GIB, 80 * GIB], 512 * GIB),
        ("sim2", [24 * GIB], 64 * GIB),
    ]
    assert (built.models[0].host, built.models[0].state) == (None, "stopped")
    for bad in ["", "2x", "x80GiB", "0x80GiB", "2x80Gibberish", "100x80GiB"]:
        with pytest.raises(UserError, match="--hosts"):
            scenario.parse_hosts(bad)


# -- the command ---------------------------------------------------------------------------


@pytest.fixture
def two_models(cli, gpu24, tmp_path):
    """Two 16 GiB simulated vLLM models on the simulated 24 GiB GPU, and a trace."""
    assert cli("engine", "add", "sim", "--kind", "vllm", "--command",
               "python -m hostagent.sim vllm").code == 0  # fmt: skip
    for name in ("chat", "code"):
        assert cli("deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
                   "--gpu-memory", "16GiB", "--min-ready", "0").code == 0  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    lines = [json.dumps({"at": r.at, "model": "chat" if r.model == "a" else "code",
                         "duration_ms": 200, "queued_ms": 0})
             for r in _bursts("ababab")]  # fmt: skip
    trace.write_text("\n".join(lines) + "\n")
    return trace


FAST_SETS = [x for step, seconds in FAST.items() if step != "service"
             for x in ("--set", f"*.{step}_seconds={seconds}")]  # fmt: skip


def test_simulate_prints_per_model_figures_and_compares(cli, two_models, tmp_path) -> None:
    slow = json.loads(cli("simulate", str(two_models), "--json").out)
    assert slow["overall"]["switches"]["park ram"] == 1  # vLLM's default start: 60 s
    done = cli("simulate", str(two_models), "--json", *FAST_SETS)
    assert done.code == 0, done.err
    result = json.loads(done.out)
    assert result["overall"]["requests"] == 30
    assert result["overall"]["served"] == 30
    assert result["overall"]["switches"]["start"] == 2
    parks = result["overall"]["switches"]
    # One copy of 16 GiB fits in this machine's host RAM, not two: one of them parks deep.
    assert parks["park ram"] + parks["park deep"] == 5
    assert parks["park ram"] >= 2
    assert set(result["models"]) == {"chat", "code"}

    fast = tmp_path / "fast.json"
    assert cli("simulate", str(two_models), *FAST_SETS, "--save-scenario", str(fast)).code == 0
    saved = tmp_path / "more.json"
    bigger = cli("simulate", str(two_models), "--scenario", str(fast), "--hosts", "2x24GiB",
                 "--compare", str(fast), "--save-scenario", str(saved),
                 "--timeline", str(tmp_path / "t.svg"))  # fmt: skip
    assert bigger.code == 0, bigger.err
    assert "scenario: fast -> fast with hosts 2x24GiB" in bigger.out
    row = next(line for line in bigger.out.splitlines() if line.startswith("park ram"))
    assert row.split()[2:5] == [str(parks["park ram"]), "->", "0"]  # overall: then -> now
    assert (tmp_path / "t.svg").read_text().startswith("<?xml")
    assert json.loads(saved.read_text())["hosts"][0]["name"] == "sim1"
    again = cli("simulate", str(two_models), "--scenario", str(saved), "--json")
    assert sum(json.loads(again.out)["overall"]["switches"].values()) == 2  # the starts


def test_simulate_with_bad_input_says_so_in_one_line(cli, two_models, tmp_path) -> None:
    for argv, says in [
        ([str(tmp_path / "none.jsonl")], "no such file"),
        ([str(two_models), "--set", "chat.colour=red"], "no field 'colour'"),
        ([str(two_models), "--timeline", str(tmp_path / "t.gif")], "must end in .png or .svg"),
        ([str(two_models), "--scenario", str(two_models)], "not JSON"),
        ([str(two_models), "--hosts", "lots"], "--hosts"),
    ]:
        done = cli("simulate", *argv)
        assert done.code == 2, (argv, done.err)
        assert says in done.err
        assert len(done.err.strip().splitlines()) == 1
        assert "Traceback" not in done.err


def test_the_summary_counts_idle_gpu_time() -> None:
    outcome = replay(_one_gpu(_model("a")), [Request(0.0, "a"), Request(100.0, "a")])
    figures = report.summary(outcome)["overall"]
    assert figures["idle_gpu_seconds"] == 0.0  # a holds its GPU from its start to the end
    two = Scenario([SimHost("h1", [24 * GIB, 24 * GIB], 64 * GIB)], [_model("a")])
    idle = report.summary(replay(two, [Request(0.0, "a"), Request(100.0, "a")]))["overall"]
    assert idle["idle_gpu_seconds"] == pytest.approx(100.2, abs=0.5)  # the second GPU


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_skipping_tries_that_find_nothing_changed_never_changes_an_answer(seed: int) -> None:
    """The replay plans only when something the plan decides on may have changed; planning
    at every try (as the server does, four times a second) gives the very same replay."""
    rng = random.Random(seed)  # noqa: S311 - a seeded trace, not a secret
    models = [
        _model(f"m{i}", claim_bytes=rng.choice([8, 12, 16, 20]) * GIB,
               min_ready_seconds=rng.choice([0, 2, 5]), max_turn_seconds=rng.choice([0, 3, 10]),
               priority=rng.choice([0, 0, 1]), gpus=rng.choice([1, 1, 2]),
               idle_park_seconds=rng.choice([0, 0, 20]))
        for i in range(6)
    ]  # fmt: skip
    hosts = [SimHost("h1", [24 * GIB, 24 * GIB], 40 * GIB), SimHost("h2", [24 * GIB], 16 * GIB)]
    requests, at = [], 0.0
    for _ in range(400):
        at += rng.expovariate(3)
        requests.append(Request(at, rng.choice(models).name, rng.uniform(0.05, 2.0)))
    fast = replay(Scenario(hosts, models), requests)
    every = replay(Scenario(hosts, models), requests, every_try=True)
    assert fast.plans_saved > 0 or fast.plans < every.plans
    # (the same moments, to the rounding of adding quarter seconds one by one or at once)
    assert [(round(s.at, 6), s.label, s.model, s.host, s.pools) for s in fast.switches] == [
        (round(s.at, 6), s.label, s.model, s.host, s.pools) for s in every.switches
    ]
    assert [(r.status, r.code, round(r.waited, 6)) for r in fast.requests] == [
        (r.status, r.code, round(r.waited, 6)) for r in every.requests
    ]


def test_timings_are_what_the_events_say_a_switch_took_without_the_room_made(db, gpu24) -> None:
    """A wake's event counts from when it was asked, so it holds the park that made room:
    the wake's own time is the rest."""
    from capyctl.engines.services import add_engine
    from capyctl.scheduler import actions
    from tests.scheduling import SIM, SIM_ENV, deployment

    env = {**SIM_ENV, "CAPYCTL_SIM_SLEEP_SECONDS": "0.6", "CAPYCTL_SIM_WAKE_SECONDS": "0.3"}
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=env)
    a, b = deployment("a"), deployment("b")
    actions.start(a.pk)
    actions.start(b.pk)  # parks a
    actions.ensure_ready(a.pk)  # parks b, wakes a
    measured = scenario.measured_timings()
    assert 0.6 <= measured["a"]["park_ram"] < 0.9
    b_park = measured["b"].get("park_ram", measured["b"].get("park_deep"))  # as RAM allows
    assert b_park is not None
    assert 0.6 <= b_park < 0.9
    assert 0.3 <= measured["a"]["wake_ram"] < 0.55  # not 0.9 and more: b's park is not in it
    assert measured["b"]["start"] < measured["a"]["start"] + 0.3  # nor a's park in b's start
    assert set(measured["a"]) == {"start", "park_ram", "wake_ram"}


def test_a_scenario_file_with_values_of_the_wrong_kind_is_one_line(db) -> None:
    bad = _status(gpus="many")
    with pytest.raises(UserError, match="model chat: a setting in the scenario"):
        scenario.build(bad)
    broken = _status()
    broken["hosts"][0]["pools"][0]["capacity_bytes"] = "lots"
    with pytest.raises(UserError, match="a host it cannot read"):
        scenario.build(broken)
    for left in ("512MiB", -1, True):
        with pytest.raises(UserError, match=r"^model chat: measured_residual_bytes is a num"):
            scenario.build(_status(measured_residual_bytes=left))
