"""Placement of a model's replicas: distinct GPUs, siblings never evicted, spread over hosts."""

import pytest

from capyctl.scheduler.policy import (
    STOP,
    Need,
    NoCapacity,
    Placement,
    Pool,
    _evictable,
    plan,
)
from tests.test_policy import GIB, host, need, resident

SIBLING = 501  # another replica of "chat"


def sibling(gib, *, pool="gpu0", host_id=1, **extra):
    return resident("chat", gib, pool=pool, host_id=host_id, deployment_id=SIBLING, **extra)


def other(name, gib, deployment_id, **extra):
    return resident(name, gib, deployment_id=deployment_id, **extra)


def ram_used(snapshot, gib):
    """The host's RAM with ``gib`` of it used (parked copies)."""
    snapshot.pools["ram"] = Pool("ram", snapshot.pools["ram"].capacity_bytes, gib * GIB)
    return snapshot


def placed(hosts, wanted):
    result = plan(hosts, wanted)
    assert isinstance(result, Placement), result
    return result


def replica(gib=16, gpus=1, **extra):
    return need("chat", gib, gpus, siblings=frozenset({SIBLING}), **extra)


def test_the_defaults_are_no_siblings_spread_over_hosts():
    plain = need()
    assert plain.siblings == frozenset()
    assert plain.spread == "hosts"
    with pytest.raises(ValueError, match="spread"):
        need(spread="racks")


def test_a_tighter_gpu_with_a_sibling_is_not_taken():
    # Without siblings gpu0 (4 GiB left over) is the tighter fit.
    snapshot = [host(gpus=(24, 80), residents=[sibling(4)])]
    assert plan(snapshot, need("chat")).pools == ("gpu0",)
    result = placed(snapshot, replica())
    assert (result.pools, result.victims) == (("gpu1",), ())


def test_another_model_is_parked_rather_than_share_a_gpu_with_a_sibling():
    # gpu0 has 64 GiB free, gpu1 only 8: the replica still goes on gpu1, "a" makes room.
    snapshot = [host(gpus=(80, 24), residents=[sibling(16), other("a", 16, 7, pool="gpu1")])]
    result = placed(snapshot, replica())
    assert result.pools == ("gpu1",)
    assert [v.name for v in result.victims] == ["a"]


@pytest.mark.parametrize("state", ["ready", "parked", "starting", "waking"])
def test_a_sibling_in_any_state_keeps_its_gpu(state):
    snapshot = [host(gpus=(24, 80), residents=[sibling(4, state=state)])]
    result = placed(snapshot, replica())
    assert result.pools == ("gpu1",)


def test_a_sibling_is_never_evicted_even_when_it_is_the_cheapest():
    # "chat" is the least valuable and would free the most; the replica waits for nobody
    # and parks nobody of its own: "a" on gpu1 goes instead.
    snapshot = [
        host(
            gpus=(24, 24),
            residents=[
                sibling(20, priority=-5, last_used=1.0),
                other("a", 16, 7, pool="gpu1", priority=5, last_used=900.0),
            ],
        )
    ]
    result = placed(snapshot, replica())
    assert result.pools == ("gpu1",)
    assert [v.deployment_id for v in result.victims] == [7]


def test_a_sibling_in_the_way_gives_a_lasting_no_capacity_that_says_so():
    # Evicting the sibling would make room; nothing else can.
    snapshot = [host(gpus=(24,), residents=[sibling(20)])]
    assert isinstance(plan(snapshot, need("chat")), Placement)
    result = plan(snapshot, replica())
    assert isinstance(result, NoCapacity)
    assert "no GPU without another replica of chat has room" in result.reason
    assert "\n" not in result.reason
    assert result.lasting
    assert result.blockers == ("chat (another replica)",)


def test_a_pinned_model_on_the_other_gpu_leaves_only_the_siblings_gpu():
    snapshot = [
        host(gpus=(24, 24), residents=[sibling(20), other("a", 20, 7, pool="gpu1", pinned=True)])
    ]
    result = plan(snapshot, replica())
    assert isinstance(result, NoCapacity)
    assert result.reason == (
        "chat needs 16.0 GiB per GPU; no GPU without another replica of chat has room"
    )
    assert result.blockers == ("a (pinned)", "chat (another replica)")
    assert result.lasting


def test_a_parked_siblings_copy_in_host_ram_is_not_dropped_for_a_replica():
    # The replica on gpu1 needs host RAM; only the parked sibling's copy could give it.
    parked = sibling(2, state="parked", ram_bytes=30 * GIB)
    snapshot = [ram_used(host(gpus=(24, 24), ram=40, residents=[parked]), 30)]
    without = plan(snapshot, need("chat", host_ram_bytes=20 * GIB))
    assert isinstance(without, Placement)
    assert [(v.deployment_id, v.mode) for v in without.victims] == [(SIBLING, STOP)]
    assert isinstance(plan(snapshot, replica(host_ram_bytes=20 * GIB)), NoCapacity)


def test_another_parked_copy_is_dropped_instead_of_the_siblings():
    residents = [
        sibling(2, state="parked", ram_bytes=30 * GIB, last_used=1.0),
        other("a", 2, 7, pool="gpu1", state="parked", ram_bytes=30 * GIB, last_used=50.0),
    ]
    snapshot = [ram_used(host(gpus=(24, 24), ram=64, residents=residents), 60)]
    result = placed(snapshot, replica(host_ram_bytes=20 * GIB))
    assert result.pools == ("gpu1",)
    assert [v.deployment_id for v in result.victims] == [7]


def test_a_sibling_is_not_evictable_for_its_replica():
    chat = sibling(16)
    assert _evictable(chat, need("chat"))
    assert not _evictable(chat, replica())


@pytest.mark.parametrize(("spread", "where"), [("hosts", (2, ("gpu0",))), ("gpus", (1, ("gpu1",)))])
def test_spread_hosts_takes_the_host_without_a_sibling_spread_gpus_need_not(spread, where):
    # host1's gpu1 is the tighter fit (8 GiB left over against 32 on host2).
    snapshot = [
        host(gpus=(80, 24), residents=[sibling(16)], host_id=1),
        host(gpus=(48,), host_id=2),
    ]
    result = placed(snapshot, replica(spread=spread))
    assert (result.host_id, result.pools) == where


def test_spread_hosts_prefers_the_host_with_fewer_siblings():
    more = [
        resident("chat", 4, pool="gpu0", host_id=1, deployment_id=501),
        resident("chat", 4, pool="gpu1", host_id=1, deployment_id=502),
    ]
    fewer = [resident("chat", 4, pool="gpu0", host_id=2, deployment_id=503)]
    snapshot = [
        host(gpus=(24, 24, 24), residents=more, host_id=1),
        host(gpus=(24, 48), residents=fewer, host_id=2),
    ]
    siblings = frozenset({501, 502, 503})
    result = placed(snapshot, need("chat", siblings=siblings))
    assert (result.host_id, result.pools) == (2, ("gpu1",))
    result = placed(snapshot, need("chat", siblings=siblings, spread="gpus"))
    assert (result.host_id, result.pools) == (1, ("gpu2",))


def test_spreading_never_costs_an_eviction():
    # host2 has no sibling but needs "a" parked; host1's other GPU is free.
    snapshot = [
        host(gpus=(24, 24), residents=[sibling(16)], host_id=1),
        host(gpus=(24,), residents=[other("a", 16, 7, host_id=2)], host_id=2),
    ]
    result = placed(snapshot, replica(spread="hosts"))
    assert (result.host_id, result.pools, result.victims) == (1, ("gpu1",), ())


def test_a_two_gpu_replica_avoids_the_siblings_gpu():
    # Without siblings gpu1 and gpu2 are the tightest pair.
    snapshot = [host(gpus=(80, 24, 24, 80), residents=[sibling(4, pool="gpu1")])]
    assert plan(snapshot, need("chat", gpus=2)).pools == ("gpu1", "gpu2")
    result = placed(snapshot, replica(gpus=2))
    assert result.pools == ("gpu0", "gpu2")


def test_a_two_gpu_replica_on_a_host_with_one_free_gpu_says_why():
    snapshot = [host(gpus=(80, 80), residents=[sibling(4, pool="gpu1")])]
    result = plan(snapshot, replica(gpus=2))
    assert isinstance(result, NoCapacity)
    assert result.reason == (
        "chat needs 2 GPUs of 16.0 GiB; no host has 2 GPUs without another replica of chat "
        "with room"
    )
    assert result.lasting


def test_on_unified_memory_a_host_takes_one_replica():
    # host1 is the tighter fit; its one pool holds a sibling.
    snapshot = [
        host(gpus=(64,), unified=True, residents=[sibling(30, pool="unified")], host_id=1),
        host(gpus=(128,), unified=True, host_id=2),
    ]
    assert placed(snapshot, need("chat", spread="gpus")).host_id == 1
    result = placed(snapshot, replica(spread="gpus"))
    assert (result.host_id, result.pools) == (2, ("unified",))


def test_a_unified_host_with_a_sibling_has_no_room_for_another():
    snapshot = [host(gpus=(128,), unified=True, residents=[sibling(30, pool="unified")])]
    result = plan(snapshot, replica())
    assert isinstance(result, NoCapacity)
    assert result.reason == "chat needs 16.0 GiB; no host without another replica of chat has room"
    assert result.lasting


def test_a_replica_waits_for_a_gpu_without_a_sibling():
    # "a" is starting on gpu1 and will be evictable once ready; gpu0 is larger but holds
    # a sibling, so the wait is for gpu1.
    snapshot = [
        host(
            gpus=(80, 24),
            residents=[sibling(70), other("a", 20, 7, pool="gpu1", state="starting")],
        )
    ]
    result = plan(snapshot, replica())
    assert isinstance(result, NoCapacity)
    assert not result.lasting
    assert result.pools == ("gpu1",)
    assert (
        result.reason == "chat needs 16.0 GiB per GPU and waits for room; in the way: a (starting)"
    )


def test_no_siblings_changes_nothing():
    snapshot = [host(gpus=(24, 80), residents=[other("chat", 4, SIBLING)])]
    assert plan(snapshot, need("chat")) == plan(snapshot, Need(999, "chat", 1, 16 * GIB))
