"""``capyctl simulate`` replays adapters (docs/what-if.md): a request for an adapter needs its
base ready and, where the base's engine does not hold it, a load; the least recently used
adapter with no request in flight makes room when the slots are full. A scenario turns
models into adapters of a base and back, so that "twenty fine-tunes as adapters of one
base instead of twenty models" is one command."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from typing import Any

import pytest

from capyctl.deployments.adapters import add_adapter
from capyctl.deployments.models import LoadedAdapter
from capyctl.engines.services import add_engine
from capyctl.errors import UserError
from capyctl.events.services import record_event
from capyctl.whatif import report, scenario, scenario_adapters
from capyctl.whatif.adapters import SLOTS_BUSY
from capyctl.whatif.engine import replay
from capyctl.whatif.model import (
    DEFAULT_ADAPTER_LOAD_SECONDS,
    GIB,
    Request,
    Scenario,
    SimAdapter,
    SimHost,
    SimModel,
    SimReplica,
    Timings,
)
from capyctl.whatif.outcome import Outcome
from tests.scheduling import SIM, SIM_ENV, deployment
from tests.test_whatif import FAST, _status

# A fine-tune's engine: 16 GiB, a 20 s start, parks and wakes of a few seconds.
TIMINGS = {"start": 20.0, "park_ram": 2.0, "park_deep": 1.0, "wake_ram": 3.0, "wake_deep": 10.0,
           "stop": 1.0, "service": 1.0}  # fmt: skip
TUNES = [f"ft-{i:02d}" for i in range(20)]


def _model(name: str, **extra: Any) -> SimModel:
    settings: dict[str, Any] = {"min_ready_seconds": 0, "max_turn_seconds": 5,
                                "timings": Timings(**TIMINGS)}  # fmt: skip
    settings.update(extra)
    return SimModel(name, **settings)


def _one_gpu(
    models: list[SimModel], adapters: list[SimAdapter] | None = None, gpu: int = 24 * GIB
) -> Scenario:
    return Scenario([SimHost("h1", [gpu], 256 * GIB)], models, adapters=adapters or [])


def _base(
    slots: int, names: list[str], load: float = 0.1, *, ready: bool = False, **extra: Any
) -> Scenario:
    """One base of ``slots`` adapter slots serving the adapters ``names``; ``ready``: its
    engine ready when the replay begins (else stopped)."""
    if ready:
        extra.update(state="ready", host="h1", pools=["gpu0"])
    base = _model("base", adapter_slots=slots, **extra)
    return _one_gpu([base], [SimAdapter(n, "base", load, measured=True) for n in names])


def _skewed(count: int = 600, seed: int = 7) -> list[Request]:
    """One request a second for the twenty fine-tunes, the popular ones asked most (the
    n-th most popular 1/n as often as the first), a second each."""
    pick = random.Random(seed)  # noqa: S311 - a trace, not a secret
    weights = [1 / (rank + 1) for rank in range(len(TUNES))]
    return [Request(float(i), pick.choices(TUNES, weights)[0], 1.0) for i in range(count)]


def _switches(outcome: Outcome) -> Counter[str]:
    return Counter(s.label for s in outcome.switches)


def _loads(outcome: Outcome) -> list[tuple[str, tuple[str, ...]]]:
    return [(load.adapter, load.unloaded) for load in outcome.adapter_loads]


# -- the replay -------------------------------------------------------------------------------


def test_twenty_fine_tunes_as_adapters_load_instead_of_switching_and_wait_far_less() -> None:
    # One 80 GiB GPU: four of the twenty 16 GiB models ready at once, or one base.
    requests = _skewed()
    as_models = _one_gpu([_model(n) for n in TUNES], gpu=80 * GIB)
    models = report.summary(replay(as_models, requests))["overall"]
    as_adapters = _base(8, TUNES)
    as_adapters.hosts = as_models.hosts
    outcome = replay(as_adapters, requests)
    adapters = report.summary(outcome)["overall"]
    # As models: a model not among the four ready is a park and a wake (or a start).
    assert models["served"] == len(requests)
    assert models["switches"]["start"] == 20
    assert models["switches"]["wake ram"] > 50
    assert models["switches"]["park ram"] > 50
    assert models["wait_p50_seconds"] > 10
    assert models["wait_p99_seconds"] > 100
    # As adapters of one base: its one start, no switch after it; loads instead, fewer
    # than the requests (eight slots hold the popular ones), each of 0.1 s.
    assert _switches(outcome) == Counter({"start": 1})
    # the requests that came during its start: more adapters than slots, all in flight at
    # once; those past the slots wait for a slot to free (a second's request), as the
    # server's loads do, and none is refused
    assert adapters["served"] == len(requests)
    assert not adapters["refused"]
    loads = adapters["adapter_loads"]
    assert 20 <= loads["count"] < len(requests) / 2
    assert loads["seconds"] == pytest.approx(loads["count"] * 0.1)
    assert loads["unloads"] == loads["count"] - 8  # every load past the first eight made room
    waits = [r.waited for r in outcome.requests if r.at > TIMINGS["start"] + 5]
    assert max(waits) <= 0.2 + 1e-9  # once the base is up: a load at most (and one before it)
    assert adapters["wait_p50_seconds"] <= 0.1 + 1e-9
    assert adapters["wait_p99_seconds"] < models["wait_p99_seconds"] / 5


def test_an_adapter_request_waits_for_its_bases_start_then_its_load() -> None:
    outcome = replay(_base(2, ["sql"], load=0.5), [Request(0.0, "sql", 1.0)])
    served = outcome.requests[0]
    assert (served.model, served.status, served.replica) == ("sql", 200, "base")
    assert served.waited == pytest.approx(TIMINGS["start"] + 0.5)
    assert [(s.label, s.model) for s in outcome.switches] == [("start", "base")]
    figures = report.summary(outcome)["models"]
    assert figures["sql"]["adapter_loads"] == {"count": 1, "seconds": 0.5, "unloads": 0}
    assert figures["base"]["adapter_loads"]["count"] == 1  # loads into its engine


def test_full_slots_unload_the_least_recently_used_adapter() -> None:
    # Two slots: a, b loaded; a used again, so b is the least recently used when c comes;
    # then a is, when d comes; then c, when b comes back.
    asks = [(0.0, "a"), (30.0, "b"), (40.0, "a"), (50.0, "c"), (60.0, "d"), (70.0, "b")]
    outcome = replay(_base(2, list("abcd"), ready=True),
                     [Request(at, name, 1.0) for at, name in asks])  # fmt: skip
    assert _loads(outcome) == [("a", ()), ("b", ()), ("c", ("b",)), ("d", ("a",)),
                               ("b", ("c",))]  # fmt: skip
    assert all(r.status == 200 for r in outcome.requests)


def test_a_load_waits_for_a_slot_while_every_one_serves_a_request() -> None:
    # a is the least recently used, but a long request of it is in flight when c comes:
    # b goes. When d comes, a and c both serve: d's load waits (holding the engine's turn
    # to load) for a's request to end, then unloads a, as the server's load does; its
    # wait and its load are the request's wait. e's load waits its turn behind d's, then
    # for d's request to end. A request for c, held, is sent to the engine at once.
    asks = [(0.0, "a", 100.0), (1.0, "b", 1.0), (10.0, "c", 100.0), (20.0, "d", 1.0),
            (30.0, "e", 1.0), (40.0, "c", 1.0)]  # fmt: skip
    outcome = replay(_base(2, list("abcde"), ready=True),
                     [Request(at, n, s) for at, n, s in asks])  # fmt: skip
    assert [r.status for r in outcome.requests] == [200] * 6  # none refused
    assert _loads(outcome) == [("a", ()), ("b", ()), ("c", ("b",)), ("d", ("a",)),
                               ("e", ("d",))]  # fmt: skip
    d, e, c = outcome.requests[3:]
    assert d.waited == pytest.approx(100.1 + 0.1 - 20.0)  # a's request ends at 100.1
    assert e.waited == pytest.approx(101.2 + 0.1 - 30.0)  # d's at 101.2
    assert c.waited == 0.0
    assert [load.at for load in outcome.adapter_loads[3:]] == [pytest.approx(100.1),
                                                               pytest.approx(101.2)]  # fmt: skip


def test_a_load_that_finds_no_slot_within_max_queue_seconds_is_refused() -> None:
    # The same, the base's max_queue_seconds 30: d's load gives up at 50 (503
    # adapter_slots_busy, after 30 s), e's, which began to look then, at 80; a later d loads.
    asks = [(0.0, "a", 100.0), (1.0, "b", 1.0), (10.0, "c", 100.0), (20.0, "d", 1.0),
            (30.0, "e", 1.0), (200.0, "d", 1.0)]  # fmt: skip
    outcome = replay(_base(2, list("abcde"), ready=True, max_queue_seconds=30.0),
                     [Request(at, n, s) for at, n, s in asks])  # fmt: skip
    assert [(r.status, r.code) for r in outcome.requests] == [
        (200, None), (200, None), (200, None), (503, SLOTS_BUSY), (503, SLOTS_BUSY), (200, None)
    ]  # fmt: skip
    d, e = outcome.requests[3:5]
    assert (d.waited, d.ended) == pytest.approx((30.0, 50.0))
    assert (e.waited, e.ended) == pytest.approx((50.0, 80.0))
    assert _loads(outcome) == [("a", ()), ("b", ()), ("c", ("b",)), ("d", ("a",))]
    # with no wait allowed, the load is refused at once, as the server's is
    now = replay(_base(2, list("abcd"), ready=True, max_queue_seconds=0.0),
                 [Request(at, n, s) for at, n, s in asks[:4]])  # fmt: skip
    assert (now.requests[3].status, now.requests[3].waited) == (503, 0.0)


def test_one_load_for_every_request_waiting_for_it() -> None:
    # Five requests of sql at once, the base ready: one load, all five wait for it alone.
    requests = [Request(30.0, "sql", 1.0) for _ in range(5)]
    outcome = replay(_base(2, ["sql", "poet"], load=0.5), [Request(0.0, "poet", 1.0), *requests])
    assert _loads(outcome) == [("poet", ()), ("sql", ())]
    assert [r.waited for r in outcome.requests[1:]] == [pytest.approx(0.5)] * 5
    # and while the base starts, requests of two adapters wait for the start, then one
    # load each, one after the other (one engine loads one at a time)
    asks = [Request(0.0, "sql", 1.0), Request(0.1, "poet", 1.0), Request(0.2, "sql", 1.0)]
    cold = replay(_base(2, ["sql", "poet"], load=0.5), asks)
    assert _loads(cold) == [("sql", ()), ("poet", ())]
    waits = [r.waited for r in cold.requests]
    assert waits == [pytest.approx(20.5), pytest.approx(20.9), pytest.approx(20.3)]


def test_a_deep_park_drops_the_adapters_and_a_ram_park_keeps_them() -> None:
    for park, loads in (("ram", 1), ("deep", 2)):
        sc = _base(2, ["sql"], park=park, idle_park_seconds=10.0)
        outcome = replay(sc, [Request(0.0, "sql", 1.0), Request(100.0, "sql", 1.0)])
        assert _switches(outcome)[f"park {park}"] == 1
        assert len(outcome.adapter_loads) == loads, park


def test_adapters_of_a_base_with_replicas_load_in_each_engine() -> None:
    second = SimReplica("h1", "ready", "", ["gpu1"])
    base = _model("base", adapter_slots=2, replicas=2, min_replicas=2, state="ready",
                  host="h1", pools=["gpu0"], replica_set=[second])  # fmt: skip
    sc = Scenario([SimHost("h1", [24 * GIB] * 2, 256 * GIB)], [base],
                  adapters=[SimAdapter("sql", "base")])  # fmt: skip
    outcome = replay(sc, [Request(0.0, "sql", 5.0), Request(0.5, "sql", 5.0)])
    assert sorted(load.engine for load in outcome.adapter_loads) == ["base", "base~1"]
    assert {r.replica for r in outcome.requests} == {"base", "base~1"}


# -- scenarios ---------------------------------------------------------------------------


def _twenty() -> dict[str, Any]:
    """A status-shaped scenario: the twenty fine-tunes as models of 16 GiB on one 24 GiB
    GPU, with fast timings."""
    data = _status()
    row = {**data["deployments"][0], "observed_state": "stopped", "min_ready_seconds": 0,
           "max_turn_seconds": 5, "timings": dict(TIMINGS)}  # fmt: skip
    data["deployments"] = [{**row, "name": name} for name in TUNES]
    data["ledger"] = []
    return data


def test_one_set_turns_twenty_models_into_adapters_of_a_new_base(db) -> None:
    data = _twenty()
    sets = ["base.adapter_slots=8", "ft-*.adapter_of=base"]  # the order does not matter
    turned = scenario.apply_sets(data, sets)
    built = scenario.build(turned, "adapters")
    assert [m.name for m in built.models] == ["base"]
    base = built.models[0]
    assert (base.adapter_slots, base.claim_bytes, base.timings.start) == (8, 16 * GIB, 20.0)
    assert [(a.name, a.base, a.load_seconds, a.measured) for a in built.adapters[:2]] == [
        ("ft-00", "base", DEFAULT_ADAPTER_LOAD_SECONDS, False),
        ("ft-01", "base", DEFAULT_ADAPTER_LOAD_SECONDS, False),
    ]
    assert len(built.adapters) == 20
    assert len(data["deployments"]) == 20  # the original is untouched
    result = report.summary(replay(built, _skewed(200)))
    assert result["overall"]["switches"]["start"] == 1
    assert result["overall"]["adapters_unmeasured"] == TUNES
    text = report.text(result, report.summary(replay(scenario.build(data), _skewed(200))))
    assert "adapter load" in text
    assert "adapter loads never measured take 0.1 s (ServerlessLLM's measured 83.5 ms" in text

    # and back: an adapter made a model of its own is a copy of its base, stopped
    back = scenario.apply_sets(turned, ["ft-0[01].adapter_of=", "*.adapter_load_seconds=0.05"])
    rebuilt = scenario.build(back)
    assert [m.name for m in rebuilt.models] == ["base", "ft-00", "ft-01"]
    assert rebuilt.models[1].adapter_slots == 0
    assert {a.load_seconds for a in rebuilt.adapters} == {0.05}
    assert len(rebuilt.adapters) == 18


def test_a_base_that_is_a_model_of_the_scenario_keeps_its_settings(db) -> None:
    data = _twenty()
    data["deployments"].append({**data["deployments"][0], "name": "llama", "gpu_memory_bytes":
                                20 * GIB, "adapter_slots": 4})  # fmt: skip
    built = scenario.build(scenario.apply_sets(data, ["*.adapter_of=llama"]))
    assert [(m.name, m.adapter_slots, m.claim_bytes) for m in built.models] == [
        ("llama", 4, 20 * GIB)
    ]
    assert {a.base for a in built.adapters} == {"llama"}


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["ft-*.adapter_of=base"], "its base base has 0 adapter slots; give it 1 to 256"),
        (["ft-00.adapter_of=ft-00"], "a model cannot be an adapter of itself"),
        (["nope-*.adapter_of=base"], "no model 'nope-*' in the scenario"),
        (["ft-00.adapter_of="], "no adapter 'ft-00' in the scenario"),
        (["ft-00.adapter_load_seconds=1"], "no adapter 'ft-00'"),
        (["ft-00.adapter_of=Base!"], "invalid base name 'Base!'"),
        (
            ["ft-00.adapter_of=b", "b.adapter_slots=2", "ft-01.adapter_of=ft-00"],
            "ft-00 is an adapter; a base is a model",
        ),
        (
            ["ft-00.adapter_of=b", "b.adapter_slots=2", "b.adapter_of=ft-01"],
            "b is the base of adapters",
        ),
        (
            ["ft-00.adapter_of=b", "b.adapter_slots=2", "ft-00.min_ready_seconds=3"],
            "ft-00 is an adapter of b: only adapter_of and adapter_load_seconds apply to it",
        ),
        (
            ["ft-00.adapter_of=b", "b.adapter_slots=2", "ft-00.adapter_load_seconds=soon"],
            "not a timing value",
        ),
    ],
)
def test_adapter_changes_that_cannot_be_are_one_line(db, sets: list[str], says: str) -> None:
    with pytest.raises(UserError, match=re.escape(says)):
        scenario.build(scenario.apply_sets(_twenty(), sets))


def test_a_base_whose_engine_serves_no_adapters_is_refused(db) -> None:
    data = _twenty()
    data["engines"][0]["kind"] = "tensorfold"
    for row in data["deployments"]:
        row["kind"] = "tensorfold"
    with pytest.raises(UserError, match="runs a tensorfold engine, which cannot serve adapters"):
        scenario.build(scenario.apply_sets(data, ["ft-*.adapter_of=b", "b.adapter_slots=2"]))


# -- the live configuration -------------------------------------------------------------------


def test_the_current_scenario_has_the_adapters_with_their_measured_loads(db, tmp_path) -> None:
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    deployment("base", adapter_slots=2)
    for name in ("docs", "poet", "sql"):
        add_adapter(name, "base", str(tmp_path))
    for ms in (40, 58, 90):  # the events' figures: their median
        record_event("adapter.loaded", f"adapter sql loaded into base in {ms} ms (asked for "
                     "by a request; 0.30s with its fetch)", subject="sql")  # fmt: skip
    found = scenario.current()["adapters"]  # capyctl status --json's, with the loads
    assert found == scenario_adapters.current()
    assert found == [
        {"name": "docs", "base": "base"},
        {"name": "poet", "base": "base"},
        {"name": "sql", "base": "base", "load_seconds": 0.058},
    ]
    assert LoadedAdapter.objects.count() == 0  # (rows are read where no event is left)
    built = scenario.build({**_status(), "deployments": [
        {**_status()["deployments"][0], "name": "base", "adapter_slots": 2}
    ], "adapters": found})  # fmt: skip
    assert [(a.name, a.load_seconds, a.measured) for a in built.adapters] == [
        ("docs", 0.1, False), ("poet", 0.1, False), ("sql", 0.058, True)
    ]  # fmt: skip


def test_a_warm_replay_begins_with_the_adapters_status_says_an_engine_holds(db) -> None:
    # capyctl status --json's adapters: where each is loaded; a base's slots are its
    # deployment's adapter_slots.
    data = _status(adapter_slots=2, min_ready_seconds=0)
    data["adapters"] = [
        {"name": name, "base": "chat", "source": f"/a/{name}", "state": state,
         "loaded_on": held}
        for name, state, held in (("docs", "loaded", ["chat"]), ("poet", "fetched", []),
                                  ("sql", "loaded", ["chat"]))
    ]  # fmt: skip
    asks = [Request(0.0, "sql", 1.0), Request(1.0, "docs", 1.0), Request(5.0, "poet", 1.0)]
    warm = replay(scenario.build(data, warm=True), asks)
    assert [r.waited for r in warm.requests] == [0.0, 0.0, pytest.approx(0.1)]
    assert _loads(warm) == [("poet", ("sql",))]  # full: the least recently used made room
    cold = replay(scenario.build(data), asks)  # stopped at the start: it holds none
    assert sorted(_loads(cold)) == [("docs", ()), ("poet", ("sql",)), ("sql", ())]
    # as many as its slots, the first listed first
    one = replay(scenario.build(scenario.apply_sets(data, ["chat.adapter_slots=1"]),
                                warm=True), asks)  # fmt: skip
    assert _loads(one)[0] == ("sql", ("docs",))
    data["adapters"][0]["loaded_on"] = "chat"
    with pytest.raises(UserError, match="adapter docs: loaded_on is not a list"):
        scenario.build(data)


def test_simulate_answers_the_question_in_one_command(cli, gpu24, tmp_path) -> None:
    assert cli("engine", "add", "sim", "--kind", "vllm", "--command",
               "python -m hostagent.sim vllm").code == 0  # fmt: skip
    for name in TUNES[:4]:
        assert cli("deployment", "add", name, "--engine", "sim", "--source", f"m-{name}",
                   "--gpu-memory", "16GiB", "--min-ready", "0").code == 0  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    asks = [{"at": i * 2.0, "model": TUNES[i % 4], "duration_ms": 500} for i in range(40)]
    trace.write_text("".join(json.dumps(ask) + "\n" for ask in asks))
    fast = [x for step, s in FAST.items() if step != "service"
            for x in ("--set", f"*.{step}_seconds={s}")]  # fmt: skip
    models = tmp_path / "models.json"
    assert cli("simulate", str(trace), *fast, "--save-scenario", str(models)).code == 0
    done = cli("simulate", str(trace), "--scenario", str(models), "--set", "ft-*.adapter_of=base",
               "--set", "base.adapter_slots=4", "--compare", str(models))  # fmt: skip
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    assert lines[0].startswith("scenario: models -> models with ft-*.adapter_of=base, base.")
    rows = {line[:18].strip(): line[18:].split() for line in lines[2:]}
    assert rows["adapter load"][:3] == ["0", "->", "4"]  # overall: one per fine-tune
    assert rows["adapter load time"][:5] == ["0.0", "s", "->", "0.4", "s"]
    assert rows["wake ram"][1:3] == ["->", "0"]
    wakes = int(rows["wake ram"][0]) + int(rows["wake deep"][0])
    assert wakes >= 30  # as models: nearly every request a switch
    assert rows["wake deep"][1:3] == ["->", "0"]
    assert "(ServerlessLLM's measured 83.5 ms, rounded): ft-00, ft-01, ft-02 and 1 more" in done.out
    saved = tmp_path / "adapters.json"
    assert cli("simulate", str(trace), "--set", "ft-*.adapter_of=base", "--set",
               "base.adapter_slots=4", "--save-scenario", str(saved)).code == 0  # fmt: skip
    assert [a["name"] for a in json.loads(saved.read_text())["adapters"]] == TUNES[:4]
