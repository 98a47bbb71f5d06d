"""Flight leases (server mode): whether anybody still drives a deployment through a passing
state, as a reconcile pass on another worker asks before it repairs one, across Redis
restarts and workers that stop renewing."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from capyctl.deployments.models import Deployment
from capyctl.hosts.models import Host
from capyctl.scheduler import actions, deployment_locks
from capyctl.scheduler.reconcile import reconcile
from tests.scheduling import deployment, state, vllm_engine


def leased(url, deployment_id, timeout=10.0):
    """Wait until the deployment's lease is in Redis."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while not client.exists(f"capyctl:flight:{deployment_id}"):
        assert time.monotonic() < deadline, "the lease was never taken"
        time.sleep(0.02)


def settled(keeper, timeout=15.0):
    """Wait until leases can be told (a new Redis looks like one that lost its data: for
    its first seconds nobody is taken for gone)."""
    deadline = time.monotonic() + timeout
    while keeper.held_elsewhere(999):  # nobody drives deployment 999
        assert time.monotonic() < deadline, "leases never settled"
        time.sleep(0.1)


def just_renewed(url, deployment_id):
    """Wait until the lease was renewed a moment ago: the next renewal is a whole period
    away (so what a pass sees right after a restart does not depend on luck)."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while (
        client.pttl(f"capyctl:flight:{deployment_id}") < deployment_locks.LEASE_SECONDS * 1000 - 100
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.django_db(transaction=True)
def test_a_redis_restart_does_not_get_a_start_under_way_repaired(gpu24, own_redis, monkeypatch):
    """Redis restarted without its data while a worker wakes a model: its lease was gone
    until the worker renewed it (up to 2 s), and a reconcile pass meanwhile took the wake
    for an orphan, stopped the engine being woken and marked it failed. Now nobody is
    taken for gone until the leases had the time to be renewed."""
    vllm_engine()
    a = deployment("a", wake_timeout_seconds=60)
    actions.ensure_ready(a.pk)
    host = Host.objects.get(name="local").pk
    Deployment.objects.filter(pk=a.pk).update(
        observed_state="waking", state_changed_at=timezone.now() - timedelta(seconds=6)
    )
    here = deployment_locks._RedisLeases(own_redis.url)  # the pass's process
    worker = deployment_locks._RedisLeases(own_redis.url)  # the worker driving the wake
    monkeypatch.setattr(deployment_locks, "_lease_keeper", here)
    try:
        drive_through_a_restart(own_redis, host, a, here, worker)
    finally:
        here.stop()
        worker.stop()


def drive_through_a_restart(own_redis, host, a, here, worker):
    worker.take(a.pk)
    leased(own_redis.url, a.pk)
    reconcile(host)
    assert state("a")[0] == "waking"  # driven: left alone
    just_renewed(own_redis.url, a.pk)
    own_redis.stop()
    own_redis.start()  # empty: every lease is gone
    reconcile(host)
    assert state("a")[0] == "waking", Deployment.objects.get(pk=a.pk).state_reason
    for _ in range(int(deployment_locks.SETTLE_SECONDS / 0.2) + 5):  # renewed since: still driven
        assert here.held_elsewhere(a.pk)
        time.sleep(0.2)
    worker.drop(a.pk)  # the worker is gone from it: repaired once settled
    deadline = time.monotonic() + 10
    while here.held_elsewhere(a.pk):
        assert time.monotonic() < deadline, "a lease dropped stayed held"
        time.sleep(0.1)
    reconcile(host)
    assert state("a")[0] == "failed"


def test_a_driver_that_runs_but_stopped_renewing_is_not_taken_for_gone(own_redis, monkeypatch):
    """A worker process that runs but does not renew its lease (stopped, starved: here
    SIGSTOP) lost it after 6 s, and a pass repaired the start it was driving. Its process
    still runs on this machine, a sign that needs no Redis: it is left alone, until the
    process is really gone."""
    monkeypatch.setattr(deployment_locks, "LEASE_SECONDS", 1)  # its lease lapses sooner
    code = (
        "import time\n"
        "import django\n"
        "django.setup()\n"
        "from capyctl.scheduler import deployment_locks\n"
        "deployment_locks.LEASE_SECONDS = 1\n"
        f"keeper = deployment_locks._RedisLeases({own_redis.url!r})\n"
        "keeper.take(9)\n"
        "print('driving', flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "capyctl.settings"}
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env)  # fmt: skip
    here = deployment_locks._RedisLeases(own_redis.url)
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "driving"
        leased(own_redis.url, 9)
        settled(here)
        os.kill(worker.pid, signal.SIGSTOP)
        time.sleep(deployment_locks.LEASE_SECONDS + 1.5)
        assert not redis.Redis.from_url(own_redis.url).exists("capyctl:flight:9")
        assert here.held_elsewhere(9)  # no lease, but its driver runs
        worker.kill()
        worker.wait(timeout=10)
        # Gone: a pass may repair it (at once, or once a settle a busy machine's late
        # heartbeat began has passed).
        deadline = time.monotonic() + 10
        while here.held_elsewhere(9) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not here.held_elsewhere(9)
    finally:
        worker.kill()
        worker.wait()
        here.stop()
