"""A trace replayed through a real server (tests/live_replay.py) switches exactly as the
trace says it must, and its waits are the switches' times."""

import pytest

from tests.live_replay import LiveModel, LiveTimings, replay

pytestmark = pytest.mark.e2e

TIMINGS = LiveTimings(park_ram=0.2, wake_ram=0.5, tokens_per_second=100)
BURSTS = 8  # a, b, a, b, …: each change of model is one park and one wake
PER_BURST = 5
BURST_EVERY = 2.0  # seconds: a switch (~0.8 s) and the burst's answers (~0.4 s) fit in it
SPACING = 0.05  # between the requests of a burst


def alternating_bursts() -> list[dict[str, object]]:
    return [
        {"at": burst * BURST_EVERY + i * SPACING, "model": "ab"[burst % 2], "completion_tokens": 16}
        for burst in range(BURSTS)
        for i in range(PER_BURST)
    ]


def test_alternating_bursts_switch_once_per_change_of_model():
    trace = alternating_bursts()
    assert len(trace) == 40
    # Small weights copies: a ram park needs room in the machine's own free host RAM, which
    # a busy test machine may not have for two 8 GiB copies (then a park goes deep).
    models = [LiveModel("a", weights="2GiB"), LiveModel("b", weights="2GiB")]
    result = replay(trace, models, timings=TIMINGS)
    why = result.summary()

    # Started in order, b made room by parking a: the first burst (for a) is a switch too.
    assert result.initial == {"a": "parked ram", "b": "ready"}, why
    assert result.switches == {"park ram": BURSTS, "wake ram": BURSTS}, why
    assert [r["status"] for r in result.requests] == [200] * 40, why
    # The sender keeps to the trace (a busy machine has held one back 0.14 s; the waits
    # below are measured from when each was sent, so that does not change them).
    assert all(abs(r["sent"] - r["at"]) < 0.25 for r in result.requests), why
    switch = TIMINGS.park_ram + TIMINGS.wake_ram
    for burst in range(BURSTS):
        rows = result.requests[burst * PER_BURST : (burst + 1) * PER_BURST]
        first = rows[0]["queued_ms"] / 1000
        # The first of a burst waits for the park and the wake, and CapyCTL's own share;
        # the others came during the same switch and are answered with the first.
        assert switch <= first < switch + 0.5, why
        done = rows[0]["sent"] + rows[0]["seconds"]
        for row in rows:
            assert row["queued_ms"] / 1000 < first + 0.1, why
            assert row["sent"] + row["seconds"] == pytest.approx(done, abs=0.2), why
    # Each switch in the events took the engine's time and not much more; a wake counts
    # from when it was asked, so it holds the park that made room for it.
    assert all(TIMINGS.park_ram <= s < TIMINGS.park_ram + 0.2
               for s in result.switch_seconds["park ram"]), why  # fmt: skip
    assert all(switch <= s < switch + 0.3 for s in result.switch_seconds["wake ram"]), why


def test_without_prestart_first_requests_start_their_models_and_deep_parks_wake_deep():
    timings = LiveTimings(start=0.2, park_ram=0.1, park_deep=0.3, wake_ram=0.2, wake_deep=0.6)
    models = [LiveModel("a", park="deep"), LiveModel("b")]
    trace = [{"at": 0.0, "model": "a"}, {"at": 2.5, "model": "b"},
             {"at": 5.0, "model": "a", "duration_ms": 250}]  # fmt: skip
    result = replay(trace, models, timings=timings, prestart=False)
    why = result.summary()

    assert result.initial == {"a": "stopped", "b": "stopped"}, why
    # a starts; b parks a (deep, its policy) and starts; a parks b (ram) and wakes deep.
    expected = {"start": 2, "park deep": 1, "park ram": 1, "wake deep": 1}
    assert result.switches == expected, why
    assert [r["status"] for r in result.requests] == [200] * 3, why
    assert result.requests[2]["tokens"] == 25  # 250 ms at 100 tokens a second
    third = result.requests[2]
    assert timings.park_ram + timings.wake_deep <= third["queued_ms"] / 1000 < 1.3, why
    assert third["seconds"] == pytest.approx(third["queued_ms"] / 1000 + 0.25, abs=0.2), why
    assert all(timings.park_deep <= s < timings.park_deep + 0.2
               for s in result.switch_seconds["park deep"]), why  # fmt: skip
