"""capyctl.scheduler.scaling: when a replica is brought up (woken, else started) or parked,
one step at a time, and the reason each step gives."""

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capyctl.scheduler import scaling
from capyctl.scheduler.scaling import PARK, START, WAKE, Bounds, Demand, ReplicaView, Step, decide

BOUNDS = Bounds(
    minimum=2,
    maximum=3,
    scale_up_wait_seconds=2.0,
    target_concurrency=4.0,
    idle_park_seconds=300.0,
)
NOTHING_WAITS = Demand(waiting=0, oldest_wait_seconds=0.0)


def replica(
    id: int,  # noqa: A002 - the field's own name
    state: str = "ready",
    in_flight: int = 0,
    idle: float = 0.0,
    up_since: float = 0.0,
) -> ReplicaView:
    return ReplicaView(id=id, state=state, in_flight=in_flight, idle_seconds=idle,
                       up_since=up_since)  # fmt: skip


def moved(replicas: list[ReplicaView], step: Step, state: str) -> list[ReplicaView]:
    """The replicas once ``step``'s replica is in ``state``."""
    return [dataclasses.replace(r, state=state) if r.id == step.replica_id else r for r in replicas]


def expect(
    action: str, replica_id: int, replicas: list[ReplicaView], demand: Demand, bounds: Bounds
) -> Step:
    """The step :func:`decide` takes, which must be ``action`` on ``replica_id``."""
    step = decide(replicas, demand, bounds)
    assert step is not None
    assert (step.action, step.replica_id) == (action, replica_id)
    return step


# --- rule 1: fewer up than the minimum -----------------------------------------------------


def test_below_the_minimum_a_parked_replica_is_woken_before_a_stopped_one_is_started():
    replicas = [replica(1), replica(2, "stopped"), replica(5, "parked"), replica(9, "stopped")]
    step = expect(WAKE, 5, replicas, NOTHING_WAITS, BOUNDS)
    assert step.reason == "1 of 2..3 replicas up, under the minimum 2: waking parked replica 5"


def test_below_the_minimum_with_none_parked_the_stopped_replica_of_lowest_id_is_started():
    replicas = [replica(1), replica(9, "stopped"), replica(4, "stopped")]
    step = expect(START, 4, replicas, NOTHING_WAITS, BOUNDS)
    assert step.reason == "1 of 2..3 replicas up, under the minimum 2: starting stopped replica 4"


def test_below_the_minimum_one_more_comes_up_even_while_another_is_coming_up():
    bounds = dataclasses.replace(BOUNDS, minimum=3, maximum=4)
    replicas = [replica(1), replica(2, "starting"), replica(3, "parked")]
    step = expect(WAKE, 3, replicas, NOTHING_WAITS, bounds)
    assert "2 of 3..4 replicas up (1 coming up), under the minimum 3" in step.reason


def test_with_nothing_to_wake_or_start_there_is_no_step():
    replicas = [replica(1), replica(2, "failed"), replica(3, "draining"), replica(4, "stopping")]
    assert decide(replicas, Demand(waiting=5, oldest_wait_seconds=30.0), BOUNDS) is None


def test_requests_waiting_with_no_replica_up_bring_one_up():
    replicas = [replica(1, "parked", idle=5.0), replica(2, "parked", idle=80.0)]
    bounds = dataclasses.replace(BOUNDS, minimum=1)
    # the one least idle: parked the most recently
    expect(WAKE, 1, replicas, Demand(waiting=1, oldest_wait_seconds=0.0), bounds)


# --- failed replicas -----------------------------------------------------------------------


def test_failed_replicas_count_as_neither_up_nor_available():
    # one ready and one failed: one up, under the minimum; the failed one (lowest id) is
    # not started again, the stopped one is
    replicas = [replica(1, "failed"), replica(2), replica(3, "stopped")]
    expect(START, 3, replicas, NOTHING_WAITS, BOUNDS)
    # only failed ones left to bring up: nothing
    assert decide([replica(1, "failed"), replica(2)], NOTHING_WAITS, BOUNDS) is None


def test_replicas_on_their_way_down_are_not_up():
    # two up would be enough; one of them parking leaves one up, under the minimum
    replicas = [replica(1), replica(2, "parking"), replica(3, "stopped")]
    expect(START, 3, replicas, NOTHING_WAITS, BOUNDS)


# --- rules 2 and 3: load calls for one more ------------------------------------------------


def test_a_burst_waiting_past_the_bound_wakes_one_replica_then_no_second_while_it_wakes():
    replicas = [replica(1, in_flight=4), replica(2, in_flight=4), replica(7, "parked"),
                replica(8, "parked", idle=50.0)]  # fmt: skip
    burst = Demand(waiting=3, oldest_wait_seconds=4.2)
    step = expect(WAKE, 7, replicas, burst, BOUNDS)
    assert step.reason == (
        "3 requests waited up to 4.2 s (over scale_up_wait_seconds 2 s) with 2 of 2..3 "
        "replicas up: waking parked replica 7"
    )
    assert step.figures["oldest_wait_seconds"] == 4.2
    assert step.figures["scale_up_wait_seconds"] == 2.0
    waking = moved(replicas, step, "waking")
    assert decide(waking, burst, dataclasses.replace(BOUNDS, maximum=4)) is None
    # nor while it is starting, or while its source downloads
    assert decide(moved(replicas, step, "starting"), burst, BOUNDS) is None
    assert decide(moved(replicas, step, "downloading"), burst, BOUNDS) is None


def test_a_wait_within_the_bound_brings_nothing_up():
    replicas = [replica(1, in_flight=1), replica(2, in_flight=1), replica(3, "parked")]
    assert decide(replicas, Demand(waiting=3, oldest_wait_seconds=2.0), BOUNDS) is None
    assert decide(replicas, Demand(waiting=3, oldest_wait_seconds=2.1), BOUNDS) is not None


def test_more_in_flight_than_the_target_concurrency_brings_one_up():
    replicas = [replica(1, in_flight=5), replica(2, in_flight=6), replica(3, "stopped")]
    step = expect(START, 3, replicas, NOTHING_WAITS, BOUNDS)
    assert step.reason == (
        "2 ready replicas carry 5.5 requests in flight on average (over target_concurrency 4) "
        "with 2 of 2..3 replicas up: starting stopped replica 3"
    )
    assert step.figures == {
        "up": 2, "ready": 2, "coming_up": 0, "minimum": 2, "maximum": 3, "waiting": 0,
        "oldest_wait_seconds": 0.0, "mean_in_flight": 5.5, "target_concurrency": 4.0,
    }  # fmt: skip
    # at the target, not over it: nothing
    at_target = [replica(1, in_flight=4), replica(2, in_flight=4), replica(3, "stopped")]
    assert decide(at_target, NOTHING_WAITS, BOUNDS) is None


def test_the_concurrency_counts_only_ready_replicas():
    # a draining replica's requests in flight are not the ready ones' load
    replicas = [replica(1, in_flight=2), replica(2, in_flight=2),
                replica(3, "draining", in_flight=40), replica(4, "parked")]  # fmt: skip
    assert decide(replicas, NOTHING_WAITS, BOUNDS) is None


def test_at_the_maximum_load_brings_nothing_up():
    replicas = [replica(1, in_flight=9), replica(2, in_flight=9), replica(3, in_flight=9),
                replica(4, "parked"), replica(5, "stopped")]  # fmt: skip
    assert decide(replicas, Demand(waiting=20, oldest_wait_seconds=60.0), BOUNDS) is None
    assert decide(replicas, NOTHING_WAITS, BOUNDS) is None
    # one coming up counts toward the maximum too
    replicas[2] = replica(3, "waking")
    assert decide(replicas, Demand(waiting=20, oldest_wait_seconds=60.0), BOUNDS) is None


def test_the_parked_replica_woken_is_the_one_parked_most_recently():
    replicas = [replica(1, in_flight=6), replica(2, in_flight=6),
                replica(3, "parked", idle=900.0, up_since=50.0),
                replica(4, "parked", idle=400.0, up_since=10.0),
                replica(5, "parked", idle=400.0, up_since=20.0),
                replica(6, "stopped")]  # fmt: skip
    expect(WAKE, 4, replicas, NOTHING_WAITS, BOUNDS)  # least idle, lowest id on a tie


# --- rule 4: parking idle replicas beyond the minimum --------------------------------------


def test_idle_replicas_beyond_the_minimum_are_parked_most_recently_started_first_one_at_a_time():
    bounds = dataclasses.replace(BOUNDS, minimum=2, maximum=5)
    replicas = [replica(i, idle=600.0, up_since=since)
                for i, since in ((1, 10.0), (2, 40.0), (3, 20.0), (4, 30.0), (5, 5.0))]  # fmt: skip
    parked = []
    while (step := decide(replicas, NOTHING_WAITS, bounds)) is not None:
        assert step.action == PARK
        parked.append(step.replica_id)
        replicas = moved(replicas, step, "parking")  # one step; the next sees it on its way
    assert parked == [2, 4, 3]
    assert sorted(r.id for r in replicas if r.state == "ready") == [1, 5]


def test_a_park_gives_its_reason_and_figures():
    replicas = [replica(1, idle=400.0, up_since=1.0), replica(2, idle=312.0, up_since=9.0),
                replica(3, idle=500.0, up_since=5.0)]  # fmt: skip
    step = expect(PARK, 2, replicas, NOTHING_WAITS, BOUNDS)
    assert step.reason == (
        "replica 2 idle 312 s (at least idle_park_seconds 300 s), nothing waiting, 3 ready "
        "over the minimum 2: parking replica 2, the most recently started"
    )
    figures = {"idle_seconds": 312.0, "idle_park_seconds": 300.0, "ready": 3, "minimum": 2,
               "up_since": 9.0, "waiting": 0}  # fmt: skip
    assert figures.items() <= step.figures.items()


def test_a_replica_with_requests_in_flight_or_not_idle_long_enough_is_never_parked():
    busy = replica(3, in_flight=1, idle=10_000.0, up_since=30.0)
    recent = replica(4, idle=299.9, up_since=40.0)
    quiet = replica(2, idle=300.0, up_since=20.0)
    replicas = [replica(1, idle=10_000.0, up_since=10.0), quiet, busy, recent]
    expect(PARK, 2, replicas, NOTHING_WAITS, dataclasses.replace(BOUNDS, maximum=4))
    replicas.remove(quiet)
    bounds = dataclasses.replace(BOUNDS, minimum=1, maximum=4)
    # the older one: the newer are busy or not idle long enough
    expect(PARK, 1, replicas, NOTHING_WAITS, bounds)
    assert decide([busy, recent], NOTHING_WAITS, bounds) is None


def test_nothing_is_parked_while_requests_wait():
    replicas = [replica(1, idle=900.0), replica(2, idle=900.0), replica(3, idle=900.0)]
    assert decide(replicas, NOTHING_WAITS, BOUNDS) is not None
    assert decide(replicas, Demand(waiting=1, oldest_wait_seconds=0.5), BOUNDS) is None


def test_nothing_is_parked_while_load_calls_for_more():
    # at the maximum, the ready replicas over the target concurrency: an idle one stays
    replicas = [replica(1, in_flight=9), replica(2, in_flight=9), replica(3, idle=900.0)]
    assert decide(replicas, NOTHING_WAITS, BOUNDS) is None


def test_nothing_is_parked_at_the_minimum_ready():
    # two ready at the minimum 2; the third only coming up: none of the ready is parked
    replicas = [replica(1, idle=900.0), replica(2, idle=900.0, up_since=5.0),
                replica(3, "starting")]  # fmt: skip
    assert decide(replicas, NOTHING_WAITS, BOUNDS) is None


# --- properties ----------------------------------------------------------------------------


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[ReplicaView], Demand, Bounds]:
    minimum = draw(st.integers(1, 4))
    bounds = Bounds(
        minimum=minimum,
        maximum=draw(st.integers(minimum, 6)),
        scale_up_wait_seconds=draw(st.sampled_from([0.5, 2.0, 10.0])),
        target_concurrency=draw(st.sampled_from([0.5, 1.0, 4.0])),
        idle_park_seconds=draw(st.sampled_from([1.0, 60.0, 300.0])),
    )
    ids = draw(st.lists(st.integers(1, 50), max_size=8, unique=True))
    replicas = [
        ReplicaView(
            id=i,
            state=draw(st.sampled_from(sorted(scaling.STATES))),
            in_flight=draw(st.integers(0, 6)),
            idle_seconds=draw(st.sampled_from([0.0, 1.0, 59.0, 60.0, 400.0])),
            up_since=draw(st.floats(0, 1000)),
        )
        for i in ids
    ]
    waiting = draw(st.integers(0, 5))
    wait = draw(st.sampled_from([0.0, 1.0, 3.0, 30.0])) if waiting else 0.0
    return replicas, Demand(waiting=waiting, oldest_wait_seconds=wait), bounds


@settings(max_examples=500, deadline=None)
@given(situations())
def test_a_step_never_parks_below_the_minimum_nor_brings_up_beyond_the_maximum(situation):
    replicas, demand, bounds = situation
    step = decide(replicas, demand, bounds)
    if step is None:
        return
    by_id = {r.id: r for r in replicas}
    chosen = by_id[step.replica_id]
    ready = sum(1 for r in replicas if r.state == "ready")
    up = sum(1 for r in replicas if r.state in scaling.UP)
    if step.action == PARK:
        assert chosen.state == "ready"
        assert chosen.in_flight == 0
        assert chosen.idle_seconds >= bounds.idle_park_seconds
        assert ready - 1 >= bounds.minimum
        assert demand.waiting == 0
    else:
        assert up + 1 <= bounds.maximum
        if step.action == WAKE:
            assert chosen.state == "parked"
        else:
            assert step.action == START
            assert chosen.state == "stopped"
            assert not any(r.state == "parked" for r in replicas)  # waking comes first
    assert str(up) in step.reason
    assert "\n" not in step.reason


# --- the inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"minimum": 0}, "minimum must be at least 1 (got 0)"),
        ({"minimum": 3, "maximum": 2}, "maximum must be at least minimum 3 (got 2)"),
        ({"minimum": 1.5}, "minimum must be a whole number (got 1.5)"),
        ({"maximum": True}, "maximum must be a whole number (got True)"),
        ({"scale_up_wait_seconds": 0}, "scale_up_wait_seconds must be more than 0 (got 0)"),
        ({"target_concurrency": -1.0}, "target_concurrency must be more than 0 (got -1.0)"),
        ({"idle_park_seconds": float("nan")}, "idle_park_seconds must be more than 0 (got nan)"),
    ],
)
def test_bounds_are_checked_with_a_message_naming_the_field(changes, message):
    fields = dataclasses.asdict(BOUNDS) | changes
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        Bounds(**fields)


def test_bounds_of_one_replica_are_accepted():
    assert Bounds(1, 1, 0.1, 1, 0.5).maximum == 1


def test_a_replica_in_a_state_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="replica 3: unknown state 'sleeping'"):
        replica(3, "sleeping")


def test_the_states_are_the_observed_states_of_a_deployment():
    source = (Path(__file__).resolve().parent.parent / "capyctl/deployments/models.py").read_text()
    tree = ast.parse(source)
    observed = next(
        node for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "ObservedState"
    )  # fmt: skip
    values = {
        node.value.value
        for node in observed.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    }
    assert values == scaling.STATES


def test_the_decision_imports_only_the_standard_library():
    tree = ast.parse(Path(scaling.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.module is not None
            assert not node.level
            imported.add(node.module.split(".")[0])
    assert imported
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
