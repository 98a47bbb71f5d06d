"""Placement and eviction policy: pure functions over plain data, no database."""

import pytest

from capyctl.scheduler.policy import (
    DEEP,
    RAM,
    STOP,
    Contender,
    HostSnapshot,
    Need,
    NoCapacity,
    Placement,
    Pool,
    Resident,
    plan,
)

GIB = 1024**3


def resident(name, gib, *, pool="gpu0", host_id=1, **extra):
    values = {
        "deployment_id": hash(name) % 10_000,
        "name": name,
        "host_id": host_id,
        "state": "ready",
        "gpu_bytes": {pool: gib * GIB},
        "weights_bytes": gib * GIB // 2,
        "residual_bytes": None,
        "park_policy": "auto",
        "can_park_ram": True,
        "can_park_deep": True,
        "last_used": 100.0,
        "ready_for_seconds": 600.0,
        "min_ready_seconds": 10.0,
    }
    values.update(extra)
    return Resident(**values)


def host(gpus=(24,), ram=64, residents=(), *, host_id=1, unified=False, foreign=None):
    residents = list(residents)
    pools = {}
    names = ["unified"] if unified else [f"gpu{i}" for i in range(len(gpus))]
    for name, size in zip(names, gpus, strict=True):
        used = sum(r.gpu_bytes.get(name, 0) for r in residents) + (foreign or {}).get(name, 0)
        pools[name] = Pool(name, size * GIB, used, (foreign or {}).get(name, 0))
    if not unified:
        pools["ram"] = Pool("ram", ram * GIB, 0)
    return HostSnapshot(host_id, f"host{host_id}", unified, pools, residents)


def need(name="b", gib=16, gpus=1, **extra):
    return Need(deployment_id=999, name=name, gpus=gpus, claim_per_gpu_bytes=gib * GIB, **extra)


def test_it_fits_without_evicting_anyone():
    result = plan([host(gpus=(24, 24), residents=[resident("a", 16)])], need())
    assert result == Placement(host_id=1, pools=("gpu1",), victims=())
    assert result.gpu_indices == [1]


def test_the_tightest_free_gpu_is_taken_first():
    result = plan([host(gpus=(80, 24))], need(gib=16))
    assert isinstance(result, Placement)
    assert result.pools == ("gpu1",)


def test_a_is_parked_to_ram_to_make_room_for_b():
    result = plan([host(gpus=(24,), residents=[resident("a", 16)])], need())
    assert isinstance(result, Placement)
    (victim,) = result.victims
    assert (victim.name, victim.mode) == ("a", RAM)
    assert victim.ram_copy_bytes == 8 * GIB
    assert victim.frees["gpu0"] == 16 * GIB - int(16 * GIB * 0.1)


def test_deep_when_the_copy_would_not_fit_in_host_ram():
    result = plan([host(gpus=(24,), ram=4, residents=[resident("a", 16)])], need())
    assert isinstance(result, Placement)
    (victim,) = result.victims
    assert victim.mode == DEEP
    assert victim.reason == "its copy (8.0 GiB) would not fit in host RAM (4.0 GiB free)"


def test_stop_when_the_engine_cannot_park():
    tf = resident("tf", 16, can_park_ram=False, can_park_deep=False)
    result = plan([host(residents=[tf])], need())
    assert isinstance(result, Placement)
    (victim,) = result.victims
    assert victim.mode == STOP
    assert victim.reason == "its engine cannot park"
    assert victim.frees == {"gpu0": 16 * GIB}


def test_stop_with_sizes_when_ram_only_engine_copy_does_not_fit():
    ram_only = resident("b2", 16, can_park_deep=False)
    result = plan([host(ram=3, residents=[ram_only])], need())
    assert isinstance(result, Placement)
    assert result.victims[0].mode == STOP
    assert result.victims[0].reason == "its copy (8.0 GiB) would not fit in host RAM (3.0 GiB free)"


def test_on_unified_memory_parks_are_deep():
    result = plan(
        [host(gpus=(128,), unified=True, residents=[resident("a", 100, pool="unified")])],
        need(gib=60),
    )
    assert isinstance(result, Placement)
    assert result.pools == ("unified",)
    (victim,) = result.victims
    assert victim.mode == DEEP
    assert "unified memory" in victim.reason


@pytest.mark.parametrize(("policy", "mode"), [("deep", DEEP), ("stop", STOP), ("never", STOP)])
def test_the_park_policy_limits_the_mode(policy, mode):
    result = plan([host(residents=[resident("a", 16, park_policy=policy)])], need())
    assert isinstance(result, Placement)
    assert result.victims[0].mode == mode


def test_pinned_models_are_never_evicted_and_are_named():
    result = plan([host(residents=[resident("a", 16, pinned=True)])], need())
    assert isinstance(result, NoCapacity)
    assert result.blockers == ("a (pinned)",)
    assert "in the way: a (pinned)" in result.reason
    assert result.lasting  # nothing will pass: refused at once


def test_a_model_too_large_for_any_gpu():
    result = plan([host(gpus=(24, 24))], need(gib=40))
    assert isinstance(result, NoCapacity)
    assert result.reason == "b needs 40.0 GiB per GPU; the largest GPU pool holds 24.0 GiB"
    assert result.lasting


def test_too_many_gpus():
    result = plan([host(gpus=(80, 80))], need(gpus=4))
    assert isinstance(result, NoCapacity)
    assert result.reason == "b needs 4 GPUs; the most one host has is 2"


def test_models_ready_for_less_than_min_ready_seconds_stay():
    fresh = resident("a", 16, ready_for_seconds=2.0, min_ready_seconds=10.0)
    result = plan([host(residents=[fresh])], need())
    assert isinstance(result, NoCapacity)
    assert "a (ready for less than 10s)" in result.blockers
    assert not result.lasting  # it passes: the request waits for it
    assert result.reason == (
        "b needs 16.0 GiB per GPU and waits for room; in the way: a (ready for less than 10s)"
    )


def test_models_still_starting_are_not_victims():
    result = plan([host(residents=[resident("a", 16, state="waking")])], need())
    assert isinstance(result, NoCapacity)
    assert result.blockers == ("a (waking)",)
    assert not result.lasting


def test_waiting_helps_only_if_it_fits_once_every_unpinned_model_is_gone():
    """Pinned models and memory no model holds (foreign) stay: a need that does not fit
    beside them is refused at once, whatever else is passing."""
    beside_pinned = [resident("p", 10, pinned=True), resident("a", 10, state="starting")]
    result = plan([host(residents=beside_pinned)], need())
    assert isinstance(result, NoCapacity)
    assert result.lasting
    assert result.blockers == ("a (starting)", "p (pinned)")
    fits_later = plan([host(residents=[resident("p", 4, pinned=True),
                                       resident("a", 10, state="starting")])], need())  # fmt: skip
    assert isinstance(fits_later, NoCapacity)
    assert not fits_later.lasting
    assert fits_later.reason.endswith("in the way: a (starting)")
    beside_foreign = host(
        residents=[resident("a", 10, state="starting")], foreign={"gpu0": 10 * GIB}
    )
    refused = plan([beside_foreign], need())
    assert isinstance(refused, NoCapacity)
    assert refused.lasting


def test_lower_priority_goes_first_then_least_recently_used():
    residents = [
        resident("important", 6, priority=5, last_used=1.0),
        resident("recent", 6, last_used=300.0),
        resident("old", 6, last_used=50.0),
    ]
    result = plan([host(residents=residents)], need(gib=8))
    assert isinstance(result, Placement)
    assert [v.name for v in result.victims] == ["old"]


def test_the_smallest_set_that_frees_enough_is_kept():
    residents = [
        resident("small1", 4, last_used=1.0),
        resident("small2", 4, last_used=2.0),
        resident("big", 12, last_used=3.0),
    ]
    result = plan([host(residents=residents)], need(gib=14))
    assert isinstance(result, Placement)
    assert [v.name for v in result.victims] == ["big"]


def test_a_measured_residual_is_used_when_known():
    parked_before = resident("a", 16, residual_bytes=GIB // 4)
    result = plan([host(residents=[parked_before])], need())
    assert isinstance(result, Placement)
    assert result.victims[0].frees == {"gpu0": 16 * GIB - GIB // 4}


def test_two_gpus_of_one_host():
    busy = resident("a", 20, pool="gpu1")
    result = plan([host(gpus=(24, 24, 24), residents=[busy])], need(gpus=2))
    assert isinstance(result, Placement)
    assert result.pools == ("gpu0", "gpu2")
    assert result.victims == ()


def test_multi_gpu_eviction_takes_victims_on_each_gpu():
    residents = [resident("a", 16, pool="gpu0"), resident("c", 16, pool="gpu1", last_used=500)]
    result = plan([host(gpus=(24, 24), residents=residents)], need(gpus=2))
    assert isinstance(result, Placement)
    assert sorted(v.name for v in result.victims) == ["a", "c"]


def test_a_host_where_it_fits_beats_one_where_it_must_evict():
    busy = host(residents=[resident("a", 16)], host_id=1)
    empty = host(host_id=2)
    result = plan([busy, empty], need())
    assert isinstance(result, Placement)
    assert result.host_id == 2
    pinned_to_busy = plan([busy, empty], need(host_ids=(1,)))
    assert isinstance(pinned_to_busy, Placement)
    assert pinned_to_busy.host_id == 1
    assert [v.name for v in pinned_to_busy.victims] == ["a"]


def test_offline_hosts_are_skipped():
    offline = HostSnapshot(1, "h", False, {"gpu0": Pool("gpu0", 24 * GIB, 0)}, [], online=False)
    result = plan([offline], need())
    assert isinstance(result, NoCapacity)
    assert "no online host" in result.reason


def test_foreign_memory_counts():
    result = plan([host(gpus=(24,), foreign={"gpu0": 10 * GIB})], need())
    assert isinstance(result, NoCapacity)


def test_cpu_deployments_need_no_gpu():
    result = plan([host(residents=[resident("a", 24)])], need(gpus=0, gib=0))
    assert result == Placement(host_id=1, pools=(), victims=())


def test_parked_residuals_in_the_way_are_stopped_and_cpu_deployments_wait_for_nothing():
    """A parked model keeps its residual on the GPU (a park frees no more), so a need that
    does not fit beside it stops it (it was refused at once, or waited for a room that
    never came); what it holds beyond that (memory not yet confirmed free) passes. A CPU
    deployment never waits for GPU room."""
    residual = resident("p", 20, state="parked", residual_bytes=10 * GIB)
    stopped = plan([host(residents=[residual])], need())
    assert isinstance(stopped, Placement)
    (victim,) = stopped.victims
    assert (victim.name, victim.mode) == ("p", STOP)  # 24 - 10 < 16, however long it waits
    assert victim.reason == (
        "its parked residual (10.0 GiB on gpu0) is needed: parking alone is not enough"
    )
    unconfirmed = resident("p", 20, state="parked", residual_bytes=2 * GIB)
    waits = plan([host(residents=[unconfirmed])], need())
    assert isinstance(waits, NoCapacity)
    assert not waits.lasting  # 24 - 2 >= 16 once the probe confirms the rest free
    cpu = plan([host(ram=8, residents=[resident("a", 16, state="starting")])],
               need(gpus=0, host_ram_bytes=16 * GIB))  # fmt: skip
    assert isinstance(cpu, NoCapacity)
    assert cpu.lasting


# --- turns -----------------------------------------------------------------------------------


def contended(*contenders, holder_busy=True, turn=30.0, gpus=(24,), **holder):
    """a (16 GiB, ready 600 s) holds gpu0; others wait for it."""
    a = resident("a", 16, busy=holder_busy, max_turn_seconds=turn, **holder)
    snapshot = host(gpus=gpus, residents=[a])
    return HostSnapshot(snapshot.host_id, snapshot.name, snapshot.unified, snapshot.pools,
                        snapshot.residents, contenders=tuple(contenders))  # fmt: skip


def test_a_busy_model_keeps_its_gpu_for_its_turn():
    """Two models that do not fit together: b has waited 12 s of a's 30 s turn, a is
    busy, so b waits (what is in the way passes: not lasting) and is told how long."""
    result = plan([contended()], need(waited_seconds=12.0))
    assert isinstance(result, NoCapacity)
    assert not result.lasting
    assert result.pools == ("gpu0",)
    assert result.reason == (
        "b needs 16.0 GiB per GPU and waits for room; in the way: a (busy, its turn: 18 s left)"
    )


def test_once_the_turn_is_over_the_busy_model_is_parked():
    result = plan([contended()], need(waited_seconds=30.0))
    assert isinstance(result, Placement)
    (victim,) = result.victims
    assert (victim.name, victim.mode, victim.turn_over) == ("a", RAM, True)


def test_the_turn_counts_from_when_the_holder_became_ready_if_later():
    """b has waited 40 s, but a became ready only 15 s ago (it took its turn then)."""
    result = plan([contended(ready_for_seconds=15.0)], need(waited_seconds=40.0))
    assert isinstance(result, NoCapacity)
    assert "its turn: 15 s left" in result.reason


def test_an_idle_model_gives_way_at_once_and_a_turn_of_zero_is_a_switch_per_request():
    idle = plan([contended(holder_busy=False)], need(waited_seconds=0.0))
    assert isinstance(idle, Placement)
    assert [(v.name, v.turn_over) for v in idle.victims] == [("a", False)]
    no_turns = plan([contended(turn=0.0)], need(waited_seconds=0.0))
    assert isinstance(no_turns, Placement)


def test_the_contender_that_waited_longest_goes_next():
    """b and c both wait for a's gpu0 and a's turn is over for both: c has waited
    longer, so b waits its turn behind c; c is placed."""
    c = Contender(deployment_id=5, name="c", waited_seconds=50.0, pools=("gpu0",))
    b_need = need("b", waited_seconds=35.0)
    behind = plan([contended(c)], b_need)
    assert isinstance(behind, NoCapacity)
    assert not behind.lasting
    assert behind.reason == ("b waits for its turn: c has waited longer (50 s) for the same GPUs")
    assert behind.blockers == ("c (waiting longer)",)
    first = plan([contended(Contender(999, "b", 35.0, pools=("gpu0",)))],
                 Need(5, "c", 1, 16 * GIB, waited_seconds=50.0))  # fmt: skip
    assert isinstance(first, Placement)


def test_priority_counts_as_waiting():
    """Each point of priority counts as 10 s of waiting: b (priority 2, 35 s) goes before
    c (priority 0, 50 s)."""
    c = Contender(deployment_id=5, name="c", waited_seconds=50.0, pools=("gpu0",))
    assert isinstance(plan([contended(c)], need("b", waited_seconds=35.0, priority=2)),
                      Placement)  # fmt: skip


def test_a_contender_for_other_gpus_is_not_in_the_way():
    """c waits longer, but for gpu1: b's switch on gpu0 does not wait for it; and a
    need that fits without a switch never waits for anyone."""
    c = Contender(deployment_id=5, name="c", waited_seconds=50.0, pools=("gpu1",))
    a = resident("a", 16, busy=False, max_turn_seconds=30.0)
    z = resident("z", 16, pool="gpu1", busy=True, max_turn_seconds=30.0)
    snapshot = host(gpus=(24, 24), residents=[a, z])
    two = HostSnapshot(1, "host1", False, snapshot.pools, snapshot.residents, contenders=(c,))
    result = plan([two], need("b", waited_seconds=1.0))
    assert isinstance(result, Placement)
    assert result.pools == ("gpu0",)
    free = host(gpus=(24, 24), residents=[z])
    with_free = HostSnapshot(1, "host1", False, free.pools, free.residents,
                             contenders=(Contender(5, "c", 50.0, pools=()),))  # fmt: skip
    assert plan([with_free], need("b")) == Placement(1, ("gpu0",), ())


def test_room_that_fits_a_longer_waiting_contender_is_kept_for_it():
    """gpu0 is free: c (16 GiB) has waited 5 s for it and fits there now, its holder
    parked a moment ago to make room for it. b, asked now, would fit too, but then c
    would not: b waits its turn behind c instead of taking the room c's park freed.
    A contender that would still fit beside b, or that does not fit even now, or whose
    claim is not known, does not hold b back."""
    free = host(gpus=(24,))

    def with_waiting(contender):
        return HostSnapshot(1, "host1", False, free.pools, [], contenders=(contender,))

    c = Contender(5, "c", 5.0, pools=("gpu0",), claim_per_gpu_bytes=16 * GIB)
    behind = plan([with_waiting(c)], need("b", waited_seconds=0.0))
    assert isinstance(behind, NoCapacity)
    assert not behind.lasting
    assert behind.reason == "b waits for its turn: c has waited longer (5 s) for the same GPUs"
    assert behind.blockers == ("c (waiting longer)",)
    # c, for its part, is placed: b's wait is the shorter one.
    b = Contender(999, "b", 0.5, pools=("gpu0",), claim_per_gpu_bytes=16 * GIB)
    assert plan([with_waiting(b)], Need(5, "c", 1, 16 * GIB, waited_seconds=5.0)) == Placement(
        1, ("gpu0",), ()
    )
    small = Contender(5, "c", 5.0, pools=("gpu0",), claim_per_gpu_bytes=8 * GIB)
    large = Contender(5, "c", 5.0, pools=("gpu0",), claim_per_gpu_bytes=30 * GIB)
    unknown = Contender(5, "c", 5.0, pools=("gpu0",))
    for other in (small, large, unknown):
        assert plan([with_waiting(other)], need("b")) == Placement(1, ("gpu0",), ()), other
    # On two GPUs, b takes the one c is not waiting for.
    two = host(gpus=(24, 24))
    both = HostSnapshot(1, "host1", False, two.pools, [], contenders=(c,))
    assert plan([both], need("b")) == Placement(1, ("gpu1",), ())


# --- priority classes ------------------------------------------------------------------------


def test_a_batch_model_never_ends_the_turn_of_one_serving_interactive_requests():
    """b only batch requests wait for: a, busy with interactive requests (not batch-only),
    keeps gpu0 however long b waits; once a is idle, b takes it at once."""
    long_after = plan([contended()], need(waited_seconds=10_000.0, batch=True))
    assert isinstance(long_after, NoCapacity)
    assert not long_after.lasting
    assert long_after.reason == (
        "b needs 16.0 GiB per GPU and waits for room; in the way: a (busy with interactive "
        "requests; batch waits)"
    )
    idle = plan([contended(holder_busy=False)], need(waited_seconds=0.0, batch=True))
    assert isinstance(idle, Placement)
    # Two batch models take turns as two interactive ones do.
    turn_over = plan([contended(batch=True)], need(waited_seconds=30.0, batch=True))
    assert isinstance(turn_over, Placement)
    in_turn = plan([contended(batch=True)], need(waited_seconds=29.0, batch=True))
    assert isinstance(in_turn, NoCapacity)


def test_a_model_busy_with_batch_requests_only_keeps_a_quarter_turn_against_interactive():
    """a's 30 s turn is 7.5 s against an interactive b when only batch requests keep a
    busy; against a batch b it is the whole 30 s."""
    assert isinstance(plan([contended(batch=True)], need(waited_seconds=7.0)), NoCapacity)
    result = plan([contended(batch=True)], need(waited_seconds=7.5))
    assert isinstance(result, Placement)
    assert [(v.name, v.turn_over) for v in result.victims] == [("a", True)]
    assert isinstance(plan([contended(batch=True)], need(waited_seconds=7.5, batch=True)),
                      NoCapacity)  # fmt: skip


def test_a_batch_wait_counts_for_a_quarter_and_priority_as_before():
    """a is idle: c (batch) has waited 100 s, standing 25; b (interactive) 30 s goes
    first. With priority 1 (10 s) c's standing is 35 and c goes first; with b batch too,
    both count for a quarter and the longer wait goes first."""
    c = Contender(5, "c", 100.0, pools=("gpu0",), batch=True)
    assert isinstance(plan([contended(c, holder_busy=False)], need("b", waited_seconds=30.0)),
                      Placement)  # fmt: skip
    c_high = Contender(5, "c", 100.0, priority=1, pools=("gpu0",), batch=True)
    behind = plan([contended(c_high, holder_busy=False)], need("b", waited_seconds=30.0))
    assert isinstance(behind, NoCapacity)
    assert behind.blockers == ("c (waiting longer)",)
    batch_b = need("b", waited_seconds=90.0, batch=True)
    assert isinstance(plan([contended(c, holder_busy=False)], batch_b), NoCapacity)
    longer_b = need("b", waited_seconds=101.0, batch=True)
    assert isinstance(plan([contended(c, holder_busy=False)], longer_b), Placement)


def test_a_batch_model_held_back_by_interactive_work_holds_back_no_interactive_one():
    """x (batch) has waited 400 s for gpu0, which a (busy, interactive) will not give it;
    y (interactive) has waited past a's turn: y goes, not behind x."""
    x = Contender(5, "x", 400.0, pools=("gpu0",), batch=True)
    assert isinstance(plan([contended(x)], need("y", waited_seconds=30.0)), Placement)
    # once a is batch-only itself, x could have it: x goes first (standing 100 > 30)
    behind = plan([contended(x, batch=True)], need("y", waited_seconds=30.0))
    assert isinstance(behind, NoCapacity)
    assert behind.blockers == ("x (waiting longer)",)


# --- parked residuals ------------------------------------------------------------------------


def residuals(count, gib=1.6, **extra):
    """``count`` models parked on gpu0, each leaving ``gib`` there (p0 the least recently
    used)."""
    return [resident(f"p{i}", 16, state="parked", gpu_bytes={"gpu0": int(gib * GIB)},
                     residual_bytes=int(gib * GIB), last_used=float(i), **extra)
            for i in range(count)]  # fmt: skip


def test_parked_residuals_are_stopped_least_recently_used_first_when_parking_is_not_enough():
    """Five parked models' 1.6 GiB and a ready 16 GiB model on 24 GiB: parking the ready
    one frees 14.4 GiB of the 16 needed. It was a wait for room that never came; now the
    least recently used parked model is stopped too, and only as many as needed."""
    ready = resident("r", 16, residual_bytes=int(1.6 * GIB), last_used=50.0)
    result = plan([host(residents=[*residuals(5), ready])], need())
    assert isinstance(result, Placement)
    assert [(v.name, v.mode) for v in result.victims] == [("r", RAM), ("p0", STOP)]
    # A lower priority goes first, whenever it was used; a pinned one never.
    low = [*residuals(4), resident("old", 16, state="parked", priority=-1, last_used=99.0,
                                   gpu_bytes={"gpu0": int(1.6 * GIB)})]  # fmt: skip
    result = plan([host(residents=[*low, ready])], need())
    assert isinstance(result, Placement)
    assert [v.name for v in result.victims] == ["r", "old"]
    pinned = [*residuals(5, pinned=True), ready]
    # Pinned parked models stay: the ready one is stopped instead of parked.
    result = plan([host(residents=pinned)], need())
    assert isinstance(result, Placement)
    (victim,) = result.victims
    assert (victim.name, victim.mode) == ("r", STOP)
    assert victim.reason == "parked, its residual (1.6 GiB on gpu0) would still be in the way"


def test_parked_models_are_not_stopped_while_waiting_would_make_room():
    """A stop costs a start later: while the ready model may not be parked yet (busy in its
    turn, or just ready), or a park's memory is not yet confirmed free, the need waits, and
    the parked models are not named in the way."""
    busy = resident("r", 16, busy=True, max_turn_seconds=30.0)
    waits = plan([host(residents=[*residuals(4), busy])], need())
    assert isinstance(waits, NoCapacity)
    assert not waits.lasting
    assert waits.reason == (
        "b needs 16.0 GiB per GPU and waits for room; in the way: r (busy, its turn: 30 s left)"
    )
    unconfirmed = resident("u", 16, state="parked", gpu_bytes={"gpu0": 16 * GIB})
    waits = plan([host(residents=[*residuals(2), unconfirmed])], need())
    assert isinstance(waits, NoCapacity)
    assert not waits.lasting


def test_a_wake_never_stops_its_own_model_nor_another_replica():
    ready = resident("r", 16, residual_bytes=int(1.6 * GIB), last_used=50.0)
    parked = residuals(5)
    waking = Need(deployment_id=parked[0].deployment_id, name="p0", gpus=1,
                  claim_per_gpu_bytes=16 * GIB)  # fmt: skip
    own = plan([host(residents=[*parked, ready])], waking)
    assert isinstance(own, Placement)
    assert [v.name for v in own.victims] == ["r", "p1"]
    sibling = plan([host(residents=[*parked, ready])],
                   need(siblings=frozenset({parked[0].deployment_id})))  # fmt: skip
    assert isinstance(sibling, NoCapacity)  # its GPU holds a replica: never there
