"""Engine faults seen by the scheduler: memory kept after a park, a hung wake, a crash,
foreign memory and stuck transitions."""

import os
import subprocess
import sys
import time

import pytest
from django.utils import timezone

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler import actions, errors
from capyctl.scheduler.actions import ready as ready_module
from capyctl.scheduler.reconcile import reconcile
from hostagent.simgpu import write_allocation
from tests.scheduling import GIB, SIM, SIM_ENV, deployment, entries, state


def sim_engine(name, **env):
    return add_engine(name, kind="vllm", command=f"{SIM} vllm", env={**SIM_ENV, **env})


@pytest.mark.django_db(transaction=True)
def test_memory_kept_after_a_failed_check_stays_unconfirmed_until_the_probe_shows_it_free(gpu24):
    """A park check (tests/test_verified_parks.py) whose park keeps its memory wakes the model
    again; were the wake to fail, the memory stays counted, unconfirmed, until a pass sees
    the engine let go."""
    sim_engine("sticky", CAPYCTL_SIM_KEEP_MEMORY="1")
    gpu24.runtime.release_timeout = 0.5
    a = deployment("a", engine="sticky")
    actions.ensure_ready(a.pk)
    Engine.objects.filter(name="sticky").update(park_unverified_at=timezone.now())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ready_module, "wake", lambda *args: None)  # it stays parked
        assert actions.check_park(a.pk) is False
    assert state("a") == ("parked", "ram")
    assert entries("a")["gpu0"][0] == "unconfirmed"
    assert "still sees its memory" in Deployment.objects.get(name="a").state_reason

    # The engine finally lets go: the next reconcile sees it and releases the entry.
    instance = gpu24.instance(actions.instance_key(a.instances.get()))
    assert instance is not None
    write_allocation(gpu24.probe.state_dir, instance.pid, {0: 512 * 1024**2}, 8 * GIB)
    reconcile(Host.objects.get(name="local").pk)
    assert entries("a")["gpu0"] == ("held", 512 * 1024**2)


@pytest.mark.django_db(transaction=True)
def test_a_hung_wake_fails_after_wake_timeout_and_frees_memory_once_the_process_is_gone(gpu24):
    sim_engine("hangs", CAPYCTL_SIM_HANG_ON_WAKE="1")
    a = deployment("a", engine="hangs", wake_timeout_seconds=1)
    actions.ensure_ready(a.pk)
    actions.park(a.pk, "ram")
    pid = a.instances.get().pid
    started = time.monotonic()
    with pytest.raises(errors.EngineFailedError, match="wake failed"):
        actions.ensure_ready(a.pk)
    assert time.monotonic() - started < 10
    observed, _ = state("a")
    assert observed == "failed"
    assert entries("a") == {}
    assert gpu24.probe.process_usage(pid).gpu == {}  # the process is gone, and so its memory


@pytest.mark.django_db(transaction=True)
def test_a_crash_while_ready_is_failed_and_started_again_on_the_next_request(gpu24):
    sim_engine("crashy", CAPYCTL_SIM_CRASH_AFTER="1")
    a = deployment("a", engine="crashy")
    actions.ensure_ready(a.pk)
    instance = gpu24.instance(actions.instance_key(a.instances.get()))
    assert instance is not None
    import httpx

    from tests.engine_http import engine_http

    with pytest.raises(httpx.HTTPError):
        engine_http(instance).post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {instance.api_key}"},
            json={"model": "a", "prompt": "hi"},
        )
    instance.process.wait(timeout=5)
    reconcile(Host.objects.get(name="local").pk)
    observed, _ = state("a")
    assert observed == "failed"
    assert "exited with status 3" in Deployment.objects.get(name="a").state_reason
    assert not LedgerEntry.objects.filter(deployment__name="a").exists()
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_idle_models_are_parked_after_idle_park_seconds(gpu24):
    sim_engine("sim-vllm")
    a = deployment("a", idle_park_seconds=1)
    actions.ensure_ready(a.pk)
    reconcile(Host.objects.get(name="local").pk)
    assert state("a") == ("ready", "")
    time.sleep(1.2)
    reconcile(Host.objects.get(name="local").pk)
    assert state("a")[0] == "parked"


@pytest.mark.django_db(transaction=True)
def test_memory_used_by_other_processes_counts_as_foreign(gpu24):
    sim_engine("sim-vllm")
    a = deployment("a")
    host = Host.objects.get(name="local")
    # A process CapyCTL did not start takes 10 GiB of the GPU.
    env = {
        **os.environ,
        "CAPYCTL_SIM_GPUS": "24GiB",
        "CAPYCTL_SIM_STATE_DIR": str(gpu24.probe.state_dir),
        "CAPYCTL_SIM_GPU_BYTES": "10GiB",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    from hostagent.runtime import free_port

    other = subprocess.Popen(
        [sys.executable, "-m", "hostagent.sim", "llamacpp", "-m", "/m", "--port", str(free_port())],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while gpu24.devices()[0].used_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        reconcile(host.pk)
        foreign = LedgerEntry.objects.get(deployment=None, pool="gpu0")
        assert (foreign.status, foreign.bytes) == ("foreign", 10 * GIB)
        with pytest.raises(errors.NoCapacityError):
            actions.ensure_ready(a.pk)
    finally:
        other.terminate()
        other.wait()
    reconcile(host.pk)
    assert not LedgerEntry.objects.filter(deployment=None, pool="gpu0").exists()
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_a_transition_stuck_past_its_timeout_is_repaired(gpu24):
    from datetime import timedelta

    from django.utils import timezone

    sim_engine("sim-vllm")
    a = deployment("a", wake_timeout_seconds=5)
    actions.ensure_ready(a.pk)
    # As if a worker died in the middle of a wake a while ago.
    Deployment.objects.filter(pk=a.pk).update(
        observed_state="waking", state_changed_at=timezone.now() - timedelta(seconds=120)
    )
    reconcile(Host.objects.get(name="local").pk)
    observed, _ = state("a")
    assert observed == "failed"
    assert "stayed waking for" in Deployment.objects.get(pk=a.pk).state_reason
    assert entries("a") == {}
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_a_passing_state_nobody_drives_is_repaired_before_its_timeout(gpu24):
    """A wake whose driver died (no lock held, no lease) stayed ``waking`` for its whole
    timeout plus 30 s, and every request meanwhile waited it out; a pass now repairs it
    once it is 5 s old. One still driven is left alone until its timeout."""
    import threading
    from datetime import timedelta

    from django.utils import timezone

    from capyctl.scheduler import deployment_locks

    sim_engine("sim-vllm")
    a = deployment("a", wake_timeout_seconds=60)
    actions.ensure_ready(a.pk)
    host = Host.objects.get(name="local").pk
    six_seconds_ago = timezone.now() - timedelta(seconds=6)
    Deployment.objects.filter(pk=a.pk).update(
        observed_state="waking", state_changed_at=six_seconds_ago
    )
    holding, done = threading.Event(), threading.Event()

    def drive() -> None:  # a wake under way in this process, on another thread
        with deployment_locks.operating(a.pk, "a"):
            holding.set()
            done.wait(30)

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        assert holding.wait(30)
        reconcile(host)
        assert state("a")[0] == "waking"  # driven: left alone
    finally:
        done.set()
        driver.join(30)
    reconcile(host)  # nobody drives it any more
    assert state("a")[0] == "failed"
    assert "stayed waking for 6s" in Deployment.objects.get(pk=a.pk).state_reason
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_a_model_can_wake_over_its_own_unconfirmed_memory(gpu24):
    sim_engine("sticky", CAPYCTL_SIM_KEEP_MEMORY="1")
    gpu24.runtime.release_timeout = 0.5
    a = deployment("a", engine="sticky")
    actions.ensure_ready(a.pk)
    Engine.objects.filter(name="sticky").update(park_unverified_at=timezone.now())
    # The check's park keeps its memory, as unconfirmed; its whole claim is counted
    # already, so the wake back takes nothing more, and it is held again.
    assert actions.check_park(a.pk) is False
    assert state("a") == ("ready", "")
    assert entries("a")["gpu0"][0] == "held"
    kinds = list(Event.objects.filter(deployment=a).order_by("pk").values_list("kind", flat=True))
    assert kinds[-1] == "deployment.woke"
    assert "deployment.parked" in kinds


@pytest.mark.django_db(transaction=True)
def test_a_stop_during_a_start_waits_for_it_then_ends_it(gpu24, tmp_path):
    import threading

    from django.db import connection

    gate = tmp_path / "load-gate"  # the engine loads until this file exists
    sim_engine("slow", CAPYCTL_SIM_LOAD_GATE=str(gate))
    a = deployment("a", engine="slow")
    outcomes: dict[str, object] = {}

    def run(name: str, operation) -> None:
        try:
            outcomes[name] = operation(a.pk).observed_state
        except errors.SchedulerError as exc:
            outcomes[name] = exc
        finally:
            connection.close()

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"still waiting for {what}"
            time.sleep(0.02)

    starter = threading.Thread(target=run, args=("start", actions.ensure_ready))
    starter.start()
    # Its process may touch the gate's file before the driver has noted the launch.
    wait_for(gate.with_name("load-gate.waiting").exists, "the engine to load")
    wait_for(lambda: len(gpu24.instances()) == 1, "the driver to note the launch")
    (loading,) = gpu24.instances()
    stopper = threading.Thread(target=run, args=("stop", actions.stop))
    stopper.start()

    def states() -> tuple[str, str]:
        return Deployment.objects.filter(pk=a.pk).values_list("observed_state", "desired_state")[0]

    wait_for(lambda: states()[1] == "stopped", "the stop to arrive")
    assert states() == ("starting", "stopped")  # the stop arrived while a was starting,
    assert stopper.is_alive()  # and waits for the start (its engine still loads)
    assert loading.process.alive()
    gate.touch()  # the load ends
    starter.join(timeout=60)
    stopper.join(timeout=60)
    assert not starter.is_alive()
    assert not stopper.is_alive()
    assert outcomes == {"start": "ready", "stop": "stopped"}
    kinds = list(
        Event.objects.filter(subject="a", kind__startswith="deployment.")
        .order_by("pk")
        .values_list("kind", flat=True)
    )
    assert kinds == ["deployment.added", "deployment.starting", "deployment.ready",
                     "deployment.stopped"], kinds  # fmt: skip
    assert state("a") == ("stopped", "")
    assert entries("a") == {}
    assert gpu24.devices()[0].used_bytes == 0
    assert gpu24.instances() == []
    assert not loading.process.alive()
    actions.start(a.pk)  # and it starts again cleanly
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_an_sglang_victim_with_cpu_backup_is_stopped_rather_than_copied(gpu24, settings):
    import psutil

    settings.CAPYCTL = {
        **settings.CAPYCTL,
        "RAM_RESERVE_BYTES": psutil.virtual_memory().total - 6 * GIB,
    }
    add_engine("sim-sglang", kind="sglang", command=f"{SIM} sglang", env=SIM_ENV)
    sim_engine("sim-vllm")
    a = deployment("a", engine="sim-sglang")
    b = deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    assert state("a") == ("stopped", "")
    assert state("b") == ("ready", "")
    stopped = Event.objects.get(kind="deployment.stopped", subject="a")
    assert "instead of parking" in stopped.message


def test_a_reconcile_lease_outlives_a_long_pass_but_not_a_killed_worker(
    settings, monkeypatch, redis_url
):
    """A pass renews its Redis lease while it runs; a holder that died (a killed worker)
    keeps the host from being reconciled for one lease at most."""
    import threading

    import redis

    from capyctl.scheduler import tasks

    settings.REDIS_URL = redis_url
    settings.CELERY_TASK_ALWAYS_EAGER = False
    monkeypatch.setattr(tasks, "LEASE_SECONDS", 1)
    monkeypatch.setattr(tasks, "_RENEW_SECONDS", 0.25)
    host_id = 990_000
    client = redis.Redis.from_url(settings.REDIS_URL)
    passes: list[float] = []

    def slow_pass(pk):
        assert pk == host_id
        passes.append(time.monotonic())
        time.sleep(2.5)  # longer than the lease

    monkeypatch.setattr("capyctl.scheduler.reconcile.reconcile", slow_pass)
    first = threading.Thread(target=tasks.reconcile_host, args=(host_id,))
    first.start()
    time.sleep(1.8)  # past the first lease: only renewals keep it
    tasks.reconcile_host(host_id)  # returns at once: the pass under way covers it
    assert len(passes) == 1
    first.join()
    assert client.get(f"capyctl:reconcile:{host_id}") is None  # released at the end

    # A worker killed mid-pass: its lease is never renewed nor released.
    monkeypatch.setattr(
        "capyctl.scheduler.reconcile.reconcile", lambda pk: passes.append(time.monotonic())
    )
    assert client.lock(f"capyctl:reconcile:{host_id}", timeout=1).acquire(blocking=False)
    tasks.reconcile_host(host_id)
    assert len(passes) == 1
    time.sleep(1.2)
    tasks.reconcile_host(host_id)
    assert len(passes) == 2


def test_a_process_that_outlives_sigkill_is_reported_within_a_bound(monkeypatch, tmp_path):
    """A process stuck in the kernel (a GPU driver call) survives SIGKILL: the wait for it
    once had no bound, so the stop, and the model's lock, never ended."""
    from hostagent import process as processes
    from hostagent.errors import EngineStuckError

    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    engine = processes.start_process(
        [sys.executable, "-c", script], env=dict(os.environ), log_path=tmp_path / "stuck.log"
    )

    def never_ends(timeout: float | None) -> None:  # what waiting on a D-state process does
        raise subprocess.TimeoutExpired(str(engine.pid), timeout or 0)

    monkeypatch.setattr(processes, "KILL_WAIT_SECONDS", 0.5, raising=False)
    monkeypatch.setattr(engine, "wait", never_ends)
    started = time.monotonic()
    with pytest.raises(EngineStuckError, match=r"did not end .* after SIGKILL"):
        processes.stop_process(engine, grace_seconds=0.2)
    assert time.monotonic() - started < 30
    monkeypatch.undo()
    engine.wait(timeout=10)  # SIGKILL did end this one: the test's own process is gone


@pytest.mark.django_db(transaction=True)
def test_a_stop_whose_engine_will_not_die_fails_the_model_and_keeps_its_memory(gpu24, monkeypatch):
    """The stop's kill did not end the engine: the model is failed with the reason, what
    it held stays counted (unconfirmed), and its lock is free for the next operation."""
    from capyctl.scheduler import deployment_locks, errors
    from hostagent.errors import EngineStuckError

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    a = deployment("a")
    actions.ensure_ready(a.pk)
    held = entries("a")

    def stuck(instance_id: str, grace_seconds: float) -> int:
        raise EngineStuckError(f"engine pid 4242 did not end 30s after SIGKILL ({instance_id})")

    monkeypatch.setattr(gpu24, "stop", stuck)
    with pytest.raises(errors.EngineFailedError, match="did not end 30s after SIGKILL"):
        actions.stop(a.pk)
    deployment_now = Deployment.objects.get(pk=a.pk)
    assert deployment_now.observed_state == "failed"
    assert "did not end 30s after SIGKILL" in deployment_now.state_reason
    assert {pool: status for pool, (status, _) in entries("a").items()} == dict.fromkeys(
        held, "unconfirmed"
    )
    assert {pool: size for pool, (_, size) in entries("a").items()} == {
        pool: size for pool, (_, size) in held.items()
    }
    assert deployment_locks.flight_free(a.pk)
    monkeypatch.undo()  # the simulated engine is ended at teardown after all
