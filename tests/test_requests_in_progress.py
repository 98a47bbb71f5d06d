"""Requests in flight, counted in-process (standalone) or in Redis (server mode)."""

import threading
import time

import pytest

from capyctl.scheduler.requests_in_progress import LocalInFlight, RedisInFlight


def in_use(url):
    """Redis as counting has left it for a while: its epoch made (a Redis without one may
    have just lost its data, and the counts are unknown for the first seconds)."""
    import redis

    from capyctl.scheduler import requests_in_progress_redis

    redis.Redis.from_url(url).set(requests_in_progress_redis._EPOCH, time.time())
    return url


@pytest.fixture(params=["local", "redis"])
def tracker(request):
    if request.param == "local":
        yield LocalInFlight()
        return
    counter = RedisInFlight(in_use(request.getfixturevalue("redis_url")))
    yield counter
    counter.stop()


def test_begin_end_and_count(tracker):
    assert tracker.count(7) == 0
    tracker.begin(7)
    tracker.begin(7)
    tracker.begin(8)
    assert (tracker.count(7), tracker.count(8)) == (2, 1)
    tracker.end(7)
    tracker.end(7)
    tracker.end(7)  # one too many never goes below zero
    assert tracker.count(7) == 0
    assert tracker.count(8) == 1


def test_an_adapter_s_requests_are_counted_apart_from_its_base_s(tracker):
    """An adapter's requests are counted under its own key (minus its id), in the same
    counter as deployments', every process's in server mode, never mixed with the
    deployment of the same id."""
    from capyctl.deployments.models import Adapter

    tracker.begin(5)
    tracker.begin(Adapter.ref_of(5))
    tracker.begin(Adapter.ref_of(5))
    assert (tracker.count(5), tracker.count(Adapter.ref_of(5))) == (1, 2)
    tracker.end(Adapter.ref_of(5))
    assert (tracker.count(5), tracker.count(Adapter.ref_of(5))) == (1, 1)
    tracker.end(Adapter.ref_of(5))
    tracker.end(5)
    assert tracker.count(Adapter.ref_of(5)) == 0


def test_a_second_process_sees_redis_counts(redis_url):
    first = RedisInFlight(in_use(redis_url))
    second = RedisInFlight(redis_url)
    first.begin(3)
    second.begin(3)
    assert second.count(3) == 2
    first.end(3)  # a request ends in the process that began it
    assert second.count(3) == 1
    second.end(3)
    assert first.count(3) == 0
    first.stop()
    second.stop()


def test_a_crashed_process_s_counts_vanish_with_its_lease(redis_url, tmp_path):
    """An API process killed with a request in flight: its count held every drain of that
    model for an hour (the key's expiry); it now lasts only as long as the process's lease."""
    import os
    import signal
    import subprocess
    import sys

    from capyctl.scheduler import requests_in_progress_redis

    here = RedisInFlight(in_use(redis_url))
    code = (
        "import sys, time\n"
        "from capyctl.scheduler import requests_in_progress_redis\n"
        "requests_in_progress_redis.LEASE_SECONDS = 2\n"
        f"counter = requests_in_progress_redis.RedisInFlight({redis_url!r})\n"
        "counter.begin(11)\n"
        "print('in flight', flush=True)\n"
        "time.sleep(120)\n"
    )
    api = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert api.stdout is not None
        assert api.stdout.readline().strip() == "in flight"
        assert here.count(11) == 1
        os.kill(api.pid, signal.SIGKILL)
        api.wait(timeout=10)
        killed = time.monotonic()
        while here.count(11) != 0:
            # its lease lasts 2 s here; renewed before the kill, it may last that long after
            assert time.monotonic() - killed < 2 + 5, "the dead process's count stayed"
            time.sleep(0.1)
    finally:
        api.kill()
        api.wait()
        here.stop()
    assert requests_in_progress_redis.LEASE_SECONDS == 5  # the default, untouched in this process


def test_draining_waits_for_requests_in_flight(settings, monkeypatch):
    from capyctl.scheduler import requests_in_progress

    local = LocalInFlight()
    monkeypatch.setattr(requests_in_progress, "_tracker", local)
    local.begin(5)
    threading.Timer(0.3, lambda: local.end(5)).start()
    started = time.monotonic()
    assert requests_in_progress.wait_drained(5, timeout=5)
    assert 0.25 < time.monotonic() - started < 3
    local.begin(5)
    assert not requests_in_progress.wait_drained(5, timeout=0.2)


def test_a_closed_gate_refuses_new_requests_until_reopened(tracker):
    assert tracker.begin(4)
    tracker.close(4)  # draining: the one in flight finishes, no new one starts
    assert not tracker.begin(4)
    assert tracker.count(4) == 1
    assert tracker.begin(9)  # other deployments are not affected
    tracker.end(4)
    assert tracker.count(4) == 0
    tracker.reopen(4)
    assert tracker.begin(4)
    assert tracker.count(4) == 1


def test_a_drain_closes_the_gate_and_ready_reopens_it(monkeypatch, db):
    from capyctl.deployments.models import Deployment
    from capyctl.scheduler import requests_in_progress, transitions
    from capyctl.scheduler.actions import drain
    from tests.scheduling import deployment as add_deployment
    from tests.scheduling import vllm_engine

    local = LocalInFlight()
    monkeypatch.setattr(requests_in_progress, "_tracker", local)
    vllm_engine()
    deployment = add_deployment("gated")
    Deployment.objects.filter(pk=deployment.pk).update(observed_state="ready")
    deployment.refresh_from_db()
    assert drain.drain(deployment, "parking")
    assert not local.begin(deployment.pk)
    assert transitions.drain_abandoned(deployment)
    assert local.begin(deployment.pk)


def test_with_redis_down_requests_are_counted_here_and_no_drain_trusts_a_count(
    own_redis, monkeypatch
):
    """Redis stopped: every request failed in ``begin`` (ConnectionError, a bare 500 at the
    gateway). Now a process counts its own requests meanwhile, the shared count says it is
    unknown (a drain never takes it for zero), and once Redis is back, empty, the counts
    begun during the outage are published again before anyone trusts a count."""
    from capyctl.scheduler import requests_in_progress

    api = RedisInFlight(in_use(own_redis.url))  # the gateway's process
    worker = RedisInFlight(own_redis.url)  # the scheduler's
    try:
        assert api.begin(21)
        assert worker.count(21) == 1
        own_redis.stop()
        assert api.begin(21)  # a ready model keeps answering: counted in this process
        assert api.begin(21)
        api.end(21)
        since = api.down_since
        assert since is not None
        with pytest.raises(requests_in_progress.CountsUnknown):
            worker.count(21)
        own_redis.start()  # back, and empty: every count and lease is gone
        seen: list[object] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                seen.append(worker.count(21))
            except requests_in_progress.CountsUnknown:
                seen.append("unknown")
            if seen[-1] == 2:
                break
            time.sleep(0.05)
        # Never a count that misses a request: unknown until every process checked in.
        assert seen[-1] == 2, seen
        assert all(value in ("unknown", 2) for value in seen), seen
        assert api.down_since is None
        api.end(21)
        api.end(21)
        assert worker.count(21) == 0
    finally:
        api.stop()
        worker.stop()


def test_a_drain_gives_up_on_counts_it_cannot_see(own_redis, monkeypatch):
    from capyctl.scheduler import requests_in_progress

    counter = RedisInFlight(own_redis.url)
    monkeypatch.setattr(requests_in_progress, "_tracker", counter)
    monkeypatch.setattr(requests_in_progress, "UNKNOWN_PATIENCE_SECONDS", 0.5)
    try:
        own_redis.stop()
        started = time.monotonic()
        with pytest.raises(requests_in_progress.CountsUnknown):
            requests_in_progress.wait_drained(31, timeout=30)
        assert time.monotonic() - started < 10
        with pytest.raises(requests_in_progress.CountsUnknown):
            requests_in_progress.close(31)
    finally:
        counter.stop()


def test_a_process_started_after_redis_lost_its_data_does_not_vouch_for_the_others(own_redis):
    """Redis restarted empty, and the first to check in is a process started since (an api
    process the supervisor started again): it cannot know what the others have in flight,
    so the counts stay unknown until they have checked in. It took its own (none) for the
    whole truth, and a drain could have parked a model under a request in flight."""
    from capyctl.scheduler import requests_in_progress

    api = RedisInFlight(in_use(own_redis.url))
    newcomer = None
    try:
        assert api.begin(41)
        api.check_in = lambda: None  # type: ignore[method-assign]  # it has not checked in yet
        own_redis.stop()
        own_redis.start()
        newcomer = RedisInFlight(own_redis.url)  # checks in first
        with pytest.raises(requests_in_progress.CountsUnknown):
            newcomer.count(41)
        del api.check_in  # its next check-in, within a second
        seen = wait_for_count(newcomer, 41)
        assert seen == 1
    finally:
        api.stop()
        if newcomer is not None:
            newcomer.stop()


def wait_for_count(counter, deployment_id, timeout=15.0):
    """The count once it can be trusted."""
    from capyctl.scheduler import requests_in_progress

    deadline = time.monotonic() + timeout
    while True:
        try:
            return counter.count(deployment_id)
        except requests_in_progress.CountsUnknown:
            assert time.monotonic() < deadline, "the counts stayed unknown"
            time.sleep(0.05)


def watch_counts(counter, deployment_id, seconds, until=None):
    """Every count ``counter`` reads for ``seconds`` (``"unknown"`` where it cannot tell),
    as a drain polls them; stops early once it reads ``until``."""
    from capyctl.scheduler import requests_in_progress

    seen: list[object] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            seen.append(counter.count(deployment_id))
        except requests_in_progress.CountsUnknown:
            seen.append("unknown")
        if until is not None and seen[-1] == until:
            break
        time.sleep(0.02)
    return seen


def test_redis_back_with_its_data_after_the_leases_lapsed_never_reads_zero_under_a_request(
    own_redis, monkeypatch
):
    """Redis stopped with ``SHUTDOWN SAVE`` and started again on its RDB after the leases
    ran out: every lease was gone but the epoch was not, so the worker's first count took
    the api process for dead and read 0 while it had a request in flight. The request it
    admitted during the outage (counted here only) is published before any count is
    trusted."""
    from capyctl.scheduler import requests_in_progress_redis

    # The outage outlasts the lease sooner.
    monkeypatch.setattr(requests_in_progress_redis, "LEASE_SECONDS", 2)
    api = RedisInFlight(in_use(own_redis.url))
    worker = RedisInFlight(own_redis.url)
    try:
        assert api.begin(51)
        assert wait_for_count(worker, 51) == 1
        own_redis.shutdown_save()
        assert api.begin(51)  # admitted while Redis is away: 2 in flight
        time.sleep(requests_in_progress_redis.LEASE_SECONDS + 1)
        own_redis.start()  # with its data; every lease has lapsed
        seen = watch_counts(worker, 51, 8, until=2)
        assert seen[-1] == 2, seen
        assert set(seen) <= {"unknown", 2}, seen
    finally:
        api.stop()
        worker.stop()


def test_an_api_process_cut_off_from_redis_past_its_lease_never_reads_as_zero(
    own_redis, monkeypatch
):
    """A partition between one api process and Redis (a proxy that stops forwarding, so
    its calls time out) longer than its lease: the worker, which reaches Redis, took the
    api process for dead once its lease lapsed and read 0 with its request in flight. It
    now reads unknown for as long as the api process runs and has not checked in, and the
    request admitted meanwhile is counted once it is back."""
    from capyctl.scheduler import requests_in_progress_redis
    from tests.own_servers import PausableProxy

    monkeypatch.setattr(requests_in_progress_redis, "LEASE_SECONDS", 2)
    proxy = PausableProxy(own_redis.port)
    api = RedisInFlight(in_use(proxy.url()))
    worker = RedisInFlight(own_redis.url)
    try:
        assert api.begin(52)
        assert wait_for_count(worker, 52) == 1
        proxy.pause()
        assert api.begin(52)  # it times out: counted in the api process only
        during = watch_counts(worker, 52, requests_in_progress_redis.LEASE_SECONDS + 3)
        assert set(during) <= {"unknown", 1}, during
        assert during[-1] == "unknown"
        proxy.resume()
        after = watch_counts(worker, 52, 8, until=2)
        assert after[-1] == 2, after
        assert set(after) <= {"unknown", 2}, after
    finally:
        proxy.close()
        api.stop()
        worker.stop()


def test_a_hung_redis_costs_a_short_timeout_once_then_nothing(own_redis):
    """Redis hung (``DEBUG SLEEP``: calls time out, nothing is refused): each count and
    each request's begin waited 2 s (four counts under the host lock took 8 s). Now the
    first call waits a short timeout, and the calls after it do not ask Redis until it
    answers again."""
    from capyctl.scheduler import redislink, requests_in_progress

    api = RedisInFlight(in_use(own_redis.url))
    worker = RedisInFlight(own_redis.url)
    try:
        assert wait_for_count(worker, 61) == 0
        hung = own_redis.hang(4)
        took: list[float] = []
        for _ in range(4):
            started = time.monotonic()
            with pytest.raises(requests_in_progress.CountsUnknown):
                worker.count(61)
            took.append(time.monotonic() - started)
        started = time.monotonic()
        assert api.begin(61)  # a ready model's request goes on
        took.append(time.monotonic() - started)
        assert sum(took) < redislink.TIMEOUT_SECONDS + 0.5, took  # 10 s before
        hung.join()
        assert wait_for_count(worker, 61) == 1  # back: published, and trusted again
    finally:
        api.stop()
        worker.stop()
