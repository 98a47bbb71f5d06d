"""Priority classes: a batch key's requests use what interactive ones leave idle.

The turn rules themselves are tested on plain data in tests/test_policy.py; here, what
they come to: in the what-if replay (the server's own rules on a virtual clock), through
a real server with simulated engines, and the counts the gateway keeps of each class.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from capyctl.errors import UserError
from capyctl.scheduler import redislink, request_classes
from capyctl.whatif import scenario
from capyctl.whatif.engine import replay
from capyctl.whatif.model import GIB, Request, Scenario, SimHost, SimModel, Timings
from capyctl.whatif.outcome import Outcome

FAST = {"start": 0.5, "park_ram": 0.1, "park_deep": 0.1, "wake_ram": 0.2, "wake_deep": 0.5,
        "stop": 0.1, "service": 0.15}  # fmt: skip
INTERACTIVE_KEY, BATCH_KEY = 1, 2
TURN = 4.0  # each model's max_turn_seconds


def contended_trace(seconds: float = 30.0) -> list[dict[str, Any]]:
    """Key 1 (interactive) asks for ``a`` in pairs every 2 s; key 2 asks for ``b`` every
    0.25 s: two models that do not fit on the one GPU together."""
    rows: list[dict[str, Any]] = []
    at = 0.5
    while at < seconds:
        rows += [{"at": round(at, 3), "model": "a"}, {"at": round(at + 0.05, 3), "model": "a"}]
        at += 2.0
    at = 0.0
    while at < seconds:
        rows.append({"at": round(at, 3), "model": "b", "class": "batch"})
        at += 0.25
    return sorted(rows, key=lambda r: r["at"])


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _scenario(batch_keys: frozenset[int]) -> Scenario:
    models = [SimModel(name, min_ready_seconds=0, max_turn_seconds=TURN, timings=Timings(**FAST))
              for name in ("a", "b")]  # fmt: skip
    return Scenario([SimHost("h1", [24 * GIB], 64 * GIB)], models, batch_keys=batch_keys)


def _requests(trace: list[dict[str, Any]]) -> list[Request]:
    return [Request(row["at"], row["model"], 0.15,
                    BATCH_KEY if row.get("class") == "batch" else INTERACTIVE_KEY)
            for row in trace]  # fmt: skip


def _waits(outcome: Outcome, model: str) -> list[float]:
    return [r.waited for r in outcome.requests if r.model == model]


def test_the_replay_gives_interactive_requests_the_gpu_sooner_and_answers_every_batch_one():
    """The same trace twice: key 2 interactive, then batch. Batch: a's p99 wait is at most
    half (b's quarter turn against it, then the switch), and every b request answered."""
    requests = _requests(contended_trace())
    both = replay(_scenario(frozenset()), requests)
    classes = replay(_scenario(frozenset({BATCH_KEY})), requests)
    assert all(r.status == 200 for r in both.requests)
    assert all(r.status == 200 for r in classes.requests)
    plain, batch = p99(_waits(both, "a")), p99(_waits(classes, "a"))
    assert plain >= TURN  # a waits b's whole turn
    assert batch <= plain / 2
    assert batch <= TURN / 4 + FAST["park_ram"] + FAST["wake_ram"] + 0.5


def test_a_batch_model_waits_while_an_interactive_one_stays_busy():
    """a is kept busy by interactive requests back to back for 20 s; b, asked by a batch
    key at 1 s, waits for all of them (not a's 4 s turn), then is served at once."""
    requests = [Request(i * 0.1, "a", 0.15, INTERACTIVE_KEY) for i in range(200)]
    requests.append(Request(1.0, "b", 0.15, BATCH_KEY))
    outcome = replay(_scenario(frozenset({BATCH_KEY})), requests)
    b = next(r for r in outcome.requests if r.model == "b")
    assert b.status == 200
    assert b.waited >= 19.0
    plain = replay(_scenario(frozenset()), requests)
    assert next(r for r in plain.requests if r.model == "b").waited <= TURN + 1.0


@pytest.mark.parametrize("seed", [1, 2])
def test_skipping_tries_gives_the_same_replay_with_classes(seed: int) -> None:
    """With classes, who goes first may change with time alone (a batch wait's standing
    grows at a quarter of the rate): the replay that skips tries finds the same answers
    as planning at every try."""
    rng = random.Random(seed)  # noqa: S311 - a seeded trace, not a secret
    models = [
        SimModel(f"m{i}", claim_bytes=rng.choice([8, 12, 16, 20]) * GIB, min_ready_seconds=0,
                 max_turn_seconds=rng.choice([0, 3, 10]), priority=rng.choice([0, 0, 1]),
                 timings=Timings(**FAST))
        for i in range(5)
    ]  # fmt: skip
    hosts = [SimHost("h1", [24 * GIB, 24 * GIB], 40 * GIB)]
    requests, at = [], 0.0
    for _ in range(300):
        at += rng.expovariate(3)
        requests.append(Request(at, rng.choice(models).name, rng.uniform(0.05, 2.0),
                                rng.choice([1, 2, 3])))  # fmt: skip
    scenario = Scenario(hosts, models, batch_keys=frozenset({2, 3}))
    fast = replay(scenario, requests)
    every = replay(scenario, requests, every_try=True)
    assert [(round(s.at, 6), s.label, s.model, s.pools) for s in fast.switches] == [
        (round(s.at, 6), s.label, s.model, s.pools) for s in every.switches
    ]
    assert [(r.status, r.code, round(r.waited, 6)) for r in fast.requests] == [
        (r.status, r.code, round(r.waited, 6)) for r in every.requests
    ]
    without = replay(Scenario(hosts, models), requests)
    assert [r.waited for r in without.requests] != [r.waited for r in fast.requests]


def test_the_classes_counted_for_each_deployment(settings) -> None:
    """Standalone: the serving process's counts; batch-only means some batch and no
    interactive; a busy model none of whose requests is counted now (its last ended a
    moment ago) has the class of the last that ended, for RECENT_SECONDS."""
    settings.REDIS_URL = ""
    counts = request_classes.Classes(None)
    counts.begin(7, True)
    counts.begin(7, True)
    counts.begin(8, False)
    counts.begin(8, True)
    assert counts.own() == {7: (0, 2, False), 8: (1, 1, False)}
    assert request_classes.batch_only(counts.own(), 7)
    assert not request_classes.batch_only(counts.own(), 8)
    assert not request_classes.batch_only(counts.own(), 9)  # nobody wants it: no class
    assert not request_classes.batch_only(None, 7)  # not known: as without classes
    counts.end(7, True)
    counts.end(7, True)
    counts.end(7, True)  # one end too many changes nothing
    assert counts.own() == {7: (0, 0, True), 8: (1, 1, False)}
    assert request_classes.batch_only(counts.own(), 7, busy=True)  # in its busy grace
    assert not request_classes.batch_only(counts.own(), 7)  # a need: nobody waits for it
    counts.end(8, False)
    assert counts.own()[8] == (0, 1, False)  # a batch one still in flight counts
    assert request_classes.batch_only(counts.own(), 8)
    counts._last[7] = (True, time.monotonic() - request_classes.RECENT_SECONDS - 1)
    assert 7 not in counts.own()


def _soon(read: Callable[[], Any], expected: Any, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while read() != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_server_mode_shares_the_classes_through_redis_and_forgets_a_gone_process(redis_url):
    """Two API processes' counts add up in a worker's read; a process that stops renewing
    its counts (gone) counts no more after STALE_SECONDS; Redis away: not known."""
    one, two = request_classes.Classes(redis_url), request_classes.Classes(redis_url)
    reader = request_classes.Classes(redis_url)
    one.begin(5, False)
    two.begin(5, True)
    two.begin(6, True)
    assert _soon(reader.demand, {5: (1, 1, False), 6: (0, 1, False)})  # within 50 ms
    two.end(6, True)
    assert _soon(reader.demand, {5: (1, 1, False), 6: (0, 0, True)})
    client = redislink.client(redis_url)
    raw = client.hget(request_classes._KEY, one._process)
    old = json.loads(raw)
    old["at"] -= request_classes.STALE_SECONDS + 1
    client.hset(request_classes._KEY, "gone-process", json.dumps(old))
    client.hset(request_classes._KEY, "garbled", "not json")
    assert reader.demand() == {5: (1, 1, False), 6: (0, 0, True)}
    away = request_classes.Classes("redis://127.0.0.1:1/0")
    assert away.demand() is None

    # A process that closes its counts takes them out at once, and publishes no more
    # (its thread once renewed them into the next test's Redis, a second later).
    one.close()
    assert reader.demand() == {5: (0, 1, False), 6: (0, 0, True)}
    two.close()
    assert client.hkeys(request_classes._KEY) == []
    one.begin(7, False)
    time.sleep(request_classes.RENEW_SECONDS + 0.2)
    assert client.hkeys(request_classes._KEY) == []


@pytest.mark.e2e
def test_through_a_server_interactive_waits_halve_and_every_batch_request_is_answered():
    """Two keys contend for two models on one simulated GPU, through a real standalone
    server; the same trace twice, the second key interactive then batch: the interactive
    key's p99 wait is at most half, and all of the batch key's requests are answered."""
    from tests.live_replay import LiveModel, LiveTimings
    from tests.live_replay import replay as live

    trace = contended_trace(16.0)
    timings = LiveTimings(park_ram=0.1, wake_ram=0.2, tokens_per_second=100)
    models = [LiveModel(name, weights="2GiB", max_turn_seconds=int(TURN)) for name in "ab"]
    waits = {}
    for classes in (False, True):
        result = live(trace, models, timings=timings, classes=classes)
        why = result.summary()
        assert [r["status"] for r in result.requests] == [200] * len(trace), why
        waits[classes] = p99([r["queued_ms"] / 1000 for r in result.requests
                              if r["class"] == "interactive"])  # fmt: skip
    assert waits[False] >= TURN, waits
    assert waits[True] <= waits[False] / 2, waits


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("key.x.class=batch", "a class is a key's: key.ID.class=batch"),
        ("chat.class=batch", "a class is a key's"),
        ("key.3.class=urgent", "a class is interactive or batch"),
        ("key.-1.class=batch", "a class is a key's"),
    ],
)
def test_a_class_set_on_anything_but_a_key_id_is_one_line(item: str, says: str) -> None:
    with pytest.raises(UserError, match=says):
        scenario.apply_sets({"deployments": []}, [item])


def test_a_key_made_batch_and_back_in_the_scenario() -> None:
    data = scenario.apply_sets({"deployments": [], "batch_keys": [5]},
                               ["key.3.class=batch", "key.5.class=interactive"])  # fmt: skip
    assert data["batch_keys"] == [3]
    with pytest.raises(UserError, match="`batch_keys` must be a list of key ids"):
        scenario._batch_keys({"batch_keys": ["3"]})


def test_the_live_scenario_lists_the_keys_that_are_batch_by_their_own_class_or_team(db):
    from django.contrib.auth.models import User

    from capyctl.access.models import ApiKey, Team

    user = User.objects.create(username="bob")
    nightly = Team.objects.create(name="nightly", priority_class="batch")
    nightly.members.add(user)
    own = ApiKey.objects.create(key_id="k1", secret_hmac="x", user=user, priority_class="batch")
    by_team = ApiKey.objects.create(key_id="k2", secret_hmac="x", user=user, team=nightly)
    ApiKey.objects.create(key_id="k3", secret_hmac="x", user=user, team=nightly,
                          priority_class="interactive")  # fmt: skip
    ApiKey.objects.create(key_id="k4", secret_hmac="x", user=user)
    assert scenario.current()["batch_keys"] == sorted([own.pk, by_team.pk])


def test_a_replica_brought_up_for_batch_requests_is_batch() -> None:
    """A replica that nobody's requests name yet (a scale-up) has its model's class: the
    counts of its siblings' requests."""
    counts = {1: (0, 3, False)}
    assert request_classes.batch_only(counts, 2, group=frozenset({1}))
    assert not request_classes.batch_only(counts | {3: (1, 0, False)}, 2,
                                          group=frozenset({1, 3}))  # fmt: skip
    assert not request_classes.batch_only(counts, 2)


def test_fields_of_another_shape_or_left_by_a_gone_process_count_for_nothing_and_go(redis_url):
    reader = request_classes.Classes(redis_url)
    client = redislink.client(redis_url)
    now = time.time()
    fresh = json.dumps({"at": now, "counts": {"5": [0, 2, False, now]}})
    for field, value in {
        "ok": fresh,
        "list": json.dumps({"at": now, "counts": [[5, 1, 0, False, now]]}),
        "huge": f'{{"at": {now}, "counts": {{"5": [1e400, 0, false, 0]}}}}',
        "negative": json.dumps({"at": now, "counts": {"5": [-4, 0, False, now]}}),
        "half": json.dumps({"at": now, "counts": {"5": [1, 0, False, now], "6": "x"}}),
        "stale": json.dumps({"at": now - 60, "counts": {"5": [1, 0, False, now]}}),
    }.items():
        client.hset(request_classes._KEY, field, value)
    assert reader.demand() == {5: (0, 2, False)}
    assert client.hkeys(request_classes._KEY) == [b"ok"]  # the others removed


def test_a_busy_model_idle_on_a_tick_is_seen_idle_whether_or_not_tries_are_skipped():
    """r's last request ends at 12.55 s; with a 0.1 s grace it is idle at 12.65, a tick of
    x's wait, which a clock that added its quarter seconds one by one reaches a hair
    early: x (batch, waiting on r) starts at 12.75 either way."""
    models = [SimModel(n, claim_bytes=16 * GIB, min_ready_seconds=0, max_turn_seconds=0.5,
                       timings=Timings(**FAST)) for n in ("r", "y", "x")]  # fmt: skip
    requests = [Request(0.6 + k, "r", 0.95, INTERACTIVE_KEY) for k in range(12)]
    requests += [Request(3.8, "x", 0.15, BATCH_KEY), Request(4.05, "y", 0.15, INTERACTIVE_KEY)]
    requests.sort(key=lambda r: r.at)
    scenario = Scenario([SimHost("h1", [24 * GIB], 64 * GIB)], models,
                        batch_keys=frozenset({BATCH_KEY}))  # fmt: skip
    for every in (False, True):
        outcome = replay(scenario, requests, every_try=every)
        start = next(s for s in outcome.switches if s.model == "x" and s.kind == "start")
        assert round(start.at, 6) == 12.75, every
