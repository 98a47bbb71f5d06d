"""capyctl.scheduler.routing: which replica a request goes to (least in flight, or the
key's replica on a hash ring within a bounded load), and the key a request carries."""

import math
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from capyctl.scheduler import routing
from capyctl.scheduler.routing import Homes, Ring, affinity_key, choose, ring_of

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = ["r1", "r2", "r3", "r4"]


def keys(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)  # noqa: S311 - seeded, repeatable keys and schedules
    return [f"p:{rng.getrandbits(64):x}" for _ in range(count)]


def bound(total: int, n: int, load_factor: float = 1.25) -> int:
    return math.ceil(total / n * load_factor)


# --- with a key: the same replica, within the bound ---------------------------------------


def test_the_same_key_goes_to_the_same_replica_while_it_is_under_the_bound():
    idle = dict.fromkeys(REPLICAS, 0)
    for key in keys(50):
        first = choose(idle, key)
        assert {choose(idle, key) for _ in range(5)} == {first}
        # others busier, the key's replica still within the bound: it stays
        busy = {r: (0 if r == first else 3) for r in REPLICAS}
        assert choose(busy, key) == first
        # the key's replica past the bound: another one
        over = {r: (6 if r == first else 0) for r in REPLICAS}
        assert choose(over, key) != first
    # the keys are spread over the replicas, not all on one
    assert len({choose(idle, key) for key in keys(50)}) == len(REPLICAS)


def test_one_key_sent_again_and_again_never_takes_a_replica_past_the_bound():
    for n in (2, 3, 4, 7):
        in_flight = dict.fromkeys(range(n), 0)
        for picks in range(1, 501):
            chosen = choose(in_flight, "s:one-session")
            in_flight[chosen] += 1
            assert max(in_flight.values()) <= bound(picks, n), (n, picks, in_flight)
        # the key's own replica is full to the bound; the next ones on the ring took the rest
        assert in_flight[choose(dict.fromkeys(range(n), 0), "s:one-session")] == bound(500, n)
        assert sum(in_flight.values()) == 500


def test_with_requests_ending_the_replica_chosen_stays_within_the_bound():
    rng = random.Random(3)  # noqa: S311 - seeded, repeatable keys and schedules
    in_flight = dict.fromkeys(REPLICAS, 0)
    outstanding: list[str] = []
    hot = keys(3)
    for _ in range(2000):
        key = rng.choice(hot)
        chosen = choose(in_flight, key)
        in_flight[chosen] += 1
        outstanding.append(chosen)
        assert in_flight[chosen] <= bound(len(outstanding), len(REPLICAS))
        if outstanding and rng.random() < 0.45:
            done = outstanding.pop(rng.randrange(len(outstanding)))
            in_flight[done] -= 1


def test_a_load_factor_below_one_is_refused():
    for factor in (0.5, 0.99, float("nan")):
        with pytest.raises(ValueError, match="load_factor"):
            choose({"a": 0, "b": 0}, "k", load_factor=factor)


# --- without a key: the fewest in flight, spread -----------------------------------------


def test_without_a_key_the_fewest_in_flight_is_chosen():
    assert choose({"a": 3, "b": 1, "c": 2}) == "b"
    assert choose({"a": 0, "b": 5}, None) == "a"


def test_without_a_key_the_picks_spread_evenly_with_requests_ending_at_random():
    rng = random.Random(11)  # noqa: S311 - seeded, repeatable keys and schedules
    in_flight = dict.fromkeys(REPLICAS, 0)
    picked: Counter[str] = Counter()
    outstanding: list[str] = []
    for _ in range(1000):
        chosen = choose(in_flight)
        assert in_flight[chosen] == min(in_flight.values())
        in_flight[chosen] += 1
        picked[chosen] += 1
        outstanding.append(chosen)
        for _ in range(rng.choice((0, 0, 1, 2))):  # about as many end as start
            if outstanding:
                in_flight[outstanding.pop(rng.randrange(len(outstanding)))] -= 1
    assert set(picked) == set(REPLICAS)
    assert all(225 <= count <= 275 for count in picked.values()), picked


def test_picks_made_on_the_same_counts_take_the_tied_replicas_in_turn():
    """A burst that picks before any count goes up still spreads over the tied replicas
    (a tie broken by id would send it all to one)."""
    snapshot = {"a": 2, "b": 0, "c": 0, "d": 0, "e": 1}
    picked = Counter(choose(snapshot) for _ in range(300))
    assert set(picked) == {"b", "c", "d"}
    assert all(count == 100 for count in picked.values()), picked


# --- the ring ------------------------------------------------------------------------------


def test_adding_a_replica_moves_about_one_key_in_n_and_only_to_it():
    many = keys(20_000)
    for n in (4, 8):
        before = [f"replica-{i}" for i in range(n)]
        after = [*before, "replica-new"]
        idle_before, idle_after = dict.fromkeys(before, 0), dict.fromkeys(after, 0)
        moved = [(choose(idle_before, k), choose(idle_after, k)) for k in many]
        changed = [(old, new) for old, new in moved if old != new]
        assert all(new == "replica-new" for _, new in changed)
        share = len(changed) / len(many)
        assert 0.7 / (n + 1) < share < 1.3 / (n + 1), (n, share)
        # and each replica's share of the keys is near 1/n (256 points each)
        counts = Counter(new for _, new in moved)
        assert all(0.75 / (n + 1) < c / len(many) < 1.25 / (n + 1) for c in counts.values())


def test_removing_a_replica_moves_only_its_keys():
    idle = dict.fromkeys(REPLICAS, 0)
    fewer = dict.fromkeys(REPLICAS[:-1], 0)
    for key in keys(2000):
        old = choose(idle, key)
        if old != REPLICAS[-1]:
            assert choose(fewer, key) == old


def test_the_ring_is_built_once_per_set_of_replicas_and_ids_do_not_collide():
    a = ring_of(["x", "y"])
    assert ring_of(("y", "x")) is a
    assert ring_of({"x": 0, "y": 5}.keys()) is a
    assert ring_of(["x", "y", "z"]) is not a
    assert len(a.points) == 2 * routing.POINTS_PER_REPLICA == len(a.owners)
    assert a.points == sorted(a.points)
    # "1" point 11 and "11" point 1 are distinct points (no concatenation collision)
    ring = Ring(["1", "11"])
    assert len(set(ring.points)) == len(ring.points)
    assert Counter(ring.owners) == {"1": 256, "11": 256}


def test_the_rings_kept_are_bounded():
    for i in range(routing._RINGS_KEPT + 20):
        ring_of([f"a{i}", f"b{i}"])
    assert len(routing._rings) <= routing._RINGS_KEPT


# --- exclusion and an empty choice --------------------------------------------------------


def test_an_excluded_replica_is_never_chosen_and_its_keys_go_to_the_next_one():
    idle = dict.fromkeys(REPLICAS, 0)
    for key in keys(200):
        first = choose(idle, key)
        second = choose(idle, key, exclude={first})
        assert second != first
        assert choose(idle, key, exclude={first}) == second  # the same one each time
        assert choose(idle, None, exclude={first}) != first
        remaining = {r: 0 for r in REPLICAS if r != first}
        assert choose(remaining, key) == second  # as if the replica were gone
    assert choose({"a": 9, "b": 0}, exclude=["b"]) == "a"


def test_no_replica_to_choose_from_raises():
    with pytest.raises(ValueError, match="no replica"):
        choose({})
    with pytest.raises(ValueError, match="no replica"):
        choose({}, "k")
    with pytest.raises(ValueError, match="no replica"):
        choose({"a": 0}, "k", exclude={"a"})


# --- the affinity key ----------------------------------------------------------------------


def chat(*messages):
    return {"model": "m", "messages": list(messages)}


def test_the_key_is_the_session_header_then_the_user_then_the_prompt():
    body = chat({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert affinity_key({b"x-session-id": b"abc"}, {**body, "user": "u1"}) == "s:abc"
    assert affinity_key({"x-session-id": "abc"}, body) == "s:abc"
    assert affinity_key({}, {**body, "user": "u1"}) == "u:u1"
    assert affinity_key({}, body) == "p:Hi"  # the first user message, not the system one
    assert affinity_key({b"x-session-id": b"  "}, {**body, "user": 7}) == "p:Hi"
    parts = chat({"role": "user", "content": [
        {"type": "text", "text": "Look "}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "here"},
    ]})  # fmt: skip
    assert affinity_key(None, parts) == "p:Look here"
    assert affinity_key(None, {"prompt": "x" * 500}) == "p:" + "x" * 100
    assert affinity_key(None, {"prompt": ["first", "second"]}) == "p:first"
    assert affinity_key(None, {"input": "Tell me"}) == "p:Tell me"
    assert affinity_key(None, {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Tell"}]}]}) == "p:Tell"  # fmt: skip
    nothings: list[dict[str, Any]] = [{}, {"prompt": ""}, {"prompt": [1, 2]}, chat()]
    for nothing in nothings:
        assert affinity_key({}, nothing) is None
    # the same long prompt with other endings: one key (its first 100 characters)
    same = {affinity_key({}, chat({"role": "user", "content": "q" * 100 + tail}))
            for tail in ("a", "b", "c" * 1000)}  # fmt: skip
    assert len(same) == 1


HUGE = "z" * 10_000_000


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (None, None),
        ([], []),
        ("x-session-id", "text"),
        ({b"x-session-id": 5}, 12),
        ({b"x-session-id": None, "x-session-id": ["a"]}, 3.5),
        ({b"x-session-id": HUGE.encode()}, None),
        ({"x-session-id": HUGE}, None),
        ({}, {"user": HUGE}),
        ({}, {"user": None, "messages": [[[[[]]]], None, 1, "user", {"role": "user"}]}),
        ({}, {"messages": [{"role": "user", "content": None}]}),
        ({}, {"messages": [{"role": "user", "content": HUGE}]}),
        ({}, {"messages": [{"role": "user", "content": [HUGE, None, [1], {"text": 5}]}]}),
        ({}, {"messages": [{"role": "user", "content": [{"text": HUGE}] * 1000}]}),
        ({}, {"messages": [{"role": ["user"], "content": "x"}]}),
        ({}, {"messages": {"role": "user", "content": "x"}}),
        ({}, {"prompt": HUGE}),
        ({}, {"prompt": [[HUGE]]}),
        ({}, {"prompt": {"a": 1}}),
        ({}, {"prompt": [], "input": [None, {"role": "user", "content": {"x": 1}}]}),
        ({}, {"input": HUGE}),
        ({}, {"prompt": "\ud800 lone surrogate"}),
        ({}, {1: 2, None: 3}),
    ],
)
def test_hostile_requests_never_raise_and_their_key_is_bounded(headers, body):
    key = affinity_key(headers, body)
    assert key is None or (isinstance(key, str) and 0 < len(key) <= 2 + routing.SESSION_CHARS)
    if key is not None:
        choose(dict.fromkeys(REPLICAS, 0), key)  # any key hashes


def test_the_key_of_a_huge_body_is_read_in_bounded_time():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}] * 10**6}]}
    assert affinity_key({}, body) == "p:" + "ab" * 32  # its first 32 parts only


# --- the benchmark -------------------------------------------------------------------------


def test_the_routing_bench_runs_in_a_tiny_mode_and_prints_its_table():
    done = subprocess.run(
        [sys.executable, "bench/routing.py", "--picks", "200", "--replicas", "2", "8"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.split()[:1] == ["2"] for line in lines), done.stdout
    assert any(line.split()[:1] == ["8"] for line in lines), done.stdout
    assert "target: at most 50 µs a request at 64 replicas" in done.stdout


def test_homes_spread_keys_evenly_and_keep_each_on_its_replica():
    """Eight prompt prefixes over four replicas: two each, whatever their hashes (the ring
    alone may give one replica four and another none), and each key's requests stay on
    its replica."""
    homes: Homes[str] = Homes()
    loads = dict.fromkeys("abcd", 0)
    keys = [f"p:prefix {i}" for i in range(8)]
    first = {key: homes.choose(loads, key) for key in keys}
    assert sorted(Counter(first.values()).values()) == [2, 2, 2, 2]
    for _ in range(3):
        assert {key: homes.choose(loads, key) for key in keys} == first


def test_a_busy_home_spills_one_request_and_keeps_its_key():
    homes: Homes[str] = Homes()
    loads = {"a": 0, "b": 0}
    home = homes.choose(loads, "s:session")
    other = "b" if home == "a" else "a"
    loads[home] = 5  # past ceil(1.25 * 6 / 2) = 4
    assert homes.choose(loads, "s:session") == other
    assert homes.home_of("s:session") == home
    assert homes.choose(loads, "s:session", busy=8) == home  # under busy: not past it
    loads[home] = 0
    assert homes.choose(loads, "s:session") == home


def test_a_key_whose_replica_left_is_placed_again_and_old_keys_go():
    homes: Homes[str] = Homes(kept=3)
    loads = dict.fromkeys("abc", 0)
    home = homes.choose(loads, "k0")
    left = {r: 0 for r in loads if r != home}  # its replica is not ready
    again = homes.choose(left, "k0")
    assert again in left
    assert homes.home_of("k0") == again
    for i in range(1, 4):
        homes.choose(loads, f"k{i}")
    assert homes.home_of("k0") is None  # the least recently seen of four, three kept
    assert sorted(Counter(homes.home_of(f"k{i}") for i in range(1, 4)).values()) == [1, 1, 1]
    with pytest.raises(ValueError, match="no replica to choose from"):
        homes.choose({"a": 0}, "k1", exclude=("a",))
