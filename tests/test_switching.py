"""Switching on a simulated 24 GiB GPU with simulated engines (DESIGN §5)."""

import asyncio
import contextlib
import re
import threading
import time
from typing import Any, cast

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from capyctl.deployments.models import Deployment
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import admit, host_lock, overcommitted
from capyctl.scheduler import actions, errors, requests_in_progress
from capyctl.scheduler.drivers import set_local_driver
from hostagent.simgpu import SimSpec
from tests.scheduling import (
    GIB,
    MIB,
    SIM,
    SIM_ENV,
    deployment,
    entries,
    make_host,
    state,
    vllm_engine,
)


def gpu_ledger_matches_probe(driver):
    counted = sum(e.bytes for e in LedgerEntry.objects.filter(pool="gpu0"))
    return counted == driver.devices()[0].used_bytes


@pytest.mark.django_db(transaction=True)
def test_a_then_b_parks_a_in_ram_and_wakes_b(gpu24):
    vllm_engine()
    # a's copy is measured at its first park; b's is said (with a copy of unknown size
    # counted as all b holds on its GPU, 16 GiB, b would park deep beside a's copy).
    a, b = deployment("a"), deployment("b", weights_bytes=8 * GIB)
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert entries("a")["gpu0"][0] == "held"
    assert abs(entries("a")["gpu0"][1] - 16 * GIB) < 16 * MIB

    actions.ensure_ready(b.pk)
    assert state("a") == ("parked", "ram")
    assert state("b") == ("ready", "")
    assert entries("a")["gpu0"] == ("held", 512 * MIB)
    assert entries("a")["ram"][1] >= 8 * GIB  # the weights copy, counted in host RAM
    measured_copy = Deployment.objects.get(name="a").measured_weights_bytes
    assert measured_copy is not None
    assert abs(measured_copy - 8 * GIB) < 64 * MIB  # remembered for the next plan
    assert gpu_ledger_matches_probe(gpu24)
    assert overcommitted(Host.objects.get(name="local")) == []
    parked = Event.objects.get(kind="deployment.parked", subject="a")
    assert "to make room for b" in parked.message
    assert parked.duration_ms is not None

    # And back: b parks, a wakes from RAM.
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "ram")
    assert gpu_ledger_matches_probe(gpu24)
    assert Event.objects.filter(kind="deployment.woke", subject="a").exists()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


@pytest.mark.django_db(transaction=True)
def test_deep_when_host_ram_cannot_hold_the_copy(gpu24, settings):
    import psutil

    total = psutil.virtual_memory().total
    settings.CAPYCTL = {**settings.CAPYCTL, "RAM_RESERVE_BYTES": total - 6 * GIB}
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    assert state("a") == ("parked", "deep")
    assert entries("a")["gpu0"] == ("held", 512 * MIB)
    actions.ensure_ready(a.pk)  # a deep wake reloads the weights; b goes deep too
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "deep")


@pytest.mark.django_db(transaction=True)
def test_a_kind_that_cannot_park_is_stopped_and_started_again(gpu24):
    vllm_engine()
    tf_env = {**SIM_ENV, "CAPYCTL_SIM_GPU_BYTES": "16GiB"}  # TensorFold takes no fraction flag
    tf_env["CAPYCTL_SIM_VERSION"] = "0.5.3"  # a TensorFold without the sleep API
    add_engine("sim-tf", kind="tensorfold", command=f"{SIM} tensorfold", env=tf_env)
    tf = deployment("tf", engine="sim-tf")
    b = deployment("b")
    actions.ensure_ready(tf.pk)
    actions.ensure_ready(b.pk)
    assert state("tf") == ("stopped", "")
    assert entries("tf") == {}
    stopped = Event.objects.get(kind="deployment.stopped", subject="tf")
    assert "stopped tf instead of parking: its engine cannot park" in stopped.message
    actions.ensure_ready(tf.pk)  # its next request starts it again
    assert state("tf") == ("ready", "")
    assert state("b") == ("parked", "ram")


@pytest.mark.django_db(transaction=True)
def test_too_large_and_pinned_say_why(gpu24):
    vllm_engine()
    a = deployment("a", pinned=True)
    big = deployment("big", gib=30)
    b = deployment("b")
    with pytest.raises(errors.NoCapacityError, match=r"largest GPU pool holds 24\.0 GiB"):
        actions.ensure_ready(big.pk)
    actions.ensure_ready(a.pk)
    with pytest.raises(errors.NoCapacityError, match=r"in the way: a \(pinned\)") as info:
        actions.ensure_ready(b.pk)
    assert info.value.code == "no_capacity"
    assert state("a") == ("ready", "")
    assert state("b") == ("stopped", "")
    assert entries("b") == {}


@pytest.mark.django_db(transaction=True)
def test_a_stopped_model_is_refused_until_started(gpu24):
    vllm_engine()
    a = deployment("a")
    actions.ensure_ready(a.pk)
    actions.stop(a.pk)
    assert state("a") == ("stopped", "")
    assert entries("a") == {}
    assert gpu24.devices()[0].used_bytes == 0
    with pytest.raises(errors.ModelStoppedError):
        actions.ensure_ready(a.pk)
    actions.start(a.pk)
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
def test_many_concurrent_requests_cause_one_wake(gpu24):
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)  # a is parked now
    errors = []

    def request_a():
        try:
            actions.ensure_ready(a.pk)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=request_a) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert state("a") == ("ready", "")
    assert Event.objects.filter(kind="deployment.woke", subject="a").count() == 1


@pytest.mark.django_db(transaction=True)
def test_on_unified_memory_the_park_is_deep(tmp_path, settings):
    driver = make_host(tmp_path, settings, SimSpec(unified=True, sizes=[40 * GIB]))
    settings.CAPYCTL = {**settings.CAPYCTL, "RAM_RESERVE_BYTES": 0}
    try:
        vllm_engine()
        a, b = deployment("a", gib=24), deployment("b", gib=24)
        actions.ensure_ready(a.pk)
        actions.ensure_ready(b.pk)
        assert state("a") == ("parked", "deep")
        assert "unified" in entries("a")
        assert overcommitted(Host.objects.get(name="local")) == []
    finally:
        driver.stop_all(grace_seconds=2)
        set_local_driver(None)


@pytest.mark.django_db(transaction=True)
def test_the_celery_tasks_run_the_same_operations_in_process(gpu24):
    from capyctl.scheduler import tasks

    vllm_engine()
    a = deployment("a")
    tasks.ensure_ready.delay(a.pk)  # standalone: eager, in this process
    assert state("a") == ("ready", "")
    tasks.poll_hosts.delay()  # polls remote hosts (none), reconciles the online ones
    assert state("a") == ("ready", "")  # nothing to change while the engine runs
    # The engine dies: the next poll's reconcile finds it gone, fails a, frees its memory.
    engine = gpu24.instance(actions.instance_key(a.instances.get())).process
    assert engine.popen is not None
    engine.popen.kill()
    engine.wait(timeout=10)
    tasks.poll_hosts.delay()
    assert state("a")[0] == "failed"
    assert "its engine exited with status -9" in Deployment.objects.get(pk=a.pk).state_reason
    assert entries("a") == {}


@pytest.mark.django_db(transaction=True)
def test_a_ram_park_goes_deep_when_the_ram_was_taken_meanwhile(gpu24):
    vllm_engine()
    a, b, other = deployment("a", weights_bytes=8 * GIB), deployment("b"), deployment("other")
    actions.ensure_ready(a.pk)
    assert requests_in_progress.begin(a.pk)  # a request in flight on a holds its drain
    outcome: list[object] = []

    def request_b() -> None:
        try:
            outcome.append(actions.ensure_ready(b.pk).observed_state)
        except Exception as exc:  # asserted below
            outcome.append(exc)
        finally:
            connection.close()

    switch = threading.Thread(target=request_b)
    switch.start()
    try:
        # a was chosen and planned for a ram park (host RAM had room), and is draining.
        wait_until(lambda: state("a")[0] == "draining", "a to drain")
        # Meanwhile another switch takes all but 1 GiB of host RAM: a's 8 GiB copy no
        # longer fits.
        with host_lock(Host.objects.get(name="local").pk) as host:
            ram = next(p for p in pool_usage(host) if p.pool == "ram")
            admit(host, other.pk, {"ram": ram.free_bytes - GIB}, note="promised for a copy")
    finally:
        requests_in_progress.end(a.pk)  # the request ends, the drain with it
        switch.join(timeout=60)
    assert outcome == ["ready"]
    assert state("a") == ("parked", "deep")
    assert entries("a")["gpu0"] == ("held", 512 * MIB)
    assert entries("a")["ram"][1] < GIB  # no copy kept
    assert state("b") == ("ready", "")
    said = Event.objects.get(kind="deployment.park_mode", subject="a")
    assert said.message == "parking a deep: its copy (8.0 GiB) no longer fits in host RAM"
    parked = Event.objects.get(kind="deployment.parked", subject="a")
    assert parked.message == "parked a (deep) to make room for b"
    assert overcommitted(Host.objects.get(name="local")) == []
    actions.ensure_ready(a.pk)  # a deep wake reloads its weights
    assert state("a") == ("ready", "")


@pytest.mark.django_db(transaction=True)
async def test_a_victim_whose_requests_outlast_the_drain_timeout_stays_ready(
    gpu24, bob, database_threads
):
    """A request for b needs a parked, but a's request in flight outlasts a's drain
    timeout: the switch gives up on a, which stays ready and serves, and the request for
    b gets 503 ``unavailable``; once a's request is over, a retry succeeds."""
    from capyctl.access.services import issue_api_key
    from capyctl.gateway.app import Gateway

    def set_up() -> tuple[int, str]:
        vllm_engine()
        # One token a second, 1000 of them: a's request lasts until the client leaves.
        paced = {**SIM_ENV, "CAPYCTL_SIM_TOKENS_PER_SECOND": "1",
                 "CAPYCTL_SIM_COMPLETION_TOKENS": "1000"}  # fmt: skip
        add_engine("paced", kind="vllm", command=f"{SIM} vllm", env=paced)
        a = deployment("a", engine="paced", drain_timeout_seconds=1)
        deployment("b")
        actions.ensure_ready(a.pk)
        return a.pk, issue_api_key("bob")[1]

    a_id, key = await sync_to_async(set_up)()
    transport = httpx.ASGITransport(app=cast("Any", Gateway()))  # its scope is a plain dict
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", timeout=60,
        headers={"Authorization": f"Bearer {key}"},
    ) as client:  # fmt: skip

        def chat(model: str, **extra: object):
            messages = [{"role": "user", "content": "hi"}]
            return client.post("/v1/chat/completions",
                               json={"model": model, "messages": messages, **extra})  # fmt: skip

        long_request = asyncio.ensure_future(chat("a"))
        deadline = time.monotonic() + 60
        while requests_in_progress.count(a_id) == 0:
            assert time.monotonic() < deadline, "a's request never reached its engine"
            await asyncio.sleep(0.02)

        refused = await chat("b")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == {
            "message": "gave up parking a: 1 request(s) still in flight after 1s",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }
        assert "x-should-retry" not in refused.headers  # a retry may succeed
        assert not long_request.done()  # never cut short
        assert await sync_to_async(state)("a") == ("ready", "")
        assert await sync_to_async(state)("b") == ("stopped", "")
        assert await sync_to_async(entries)("b") == {}
        event = await Event.objects.aget(kind="deployment.drain_timeout", subject="a")
        assert event.level == "warning"
        served = await chat("a", max_tokens=1)  # a still serves new requests
        assert served.status_code == 200, served.text

        long_request.cancel()  # the client gives up on a's request
        with contextlib.suppress(asyncio.CancelledError):
            await long_request
        assert requests_in_progress.count(a_id) == 0
        retried = await chat("b", max_tokens=1)
        assert retried.status_code == 200, retried.text
    assert await sync_to_async(state)("a") == ("parked", "ram")
    assert await sync_to_async(state)("b") == ("ready", "")


@pytest.mark.django_db(transaction=True)
async def test_idleness_never_ends_a_stream_and_counts_from_its_end(gpu24, bob, database_threads):
    """A model that cannot park (TensorFold) with ``idle_park_seconds``: a stream that
    outlasts the idle time is not cut by an idle stop (idleness counted from the request's
    start did), and idleness counts again from the moment the stream ended."""
    from capyctl.access.services import issue_api_key
    from capyctl.gateway.app import Gateway
    from capyctl.scheduler import reconcile

    idle = 3

    def set_up() -> tuple[int, int, str]:
        # 18 tokens at 4 a second: a stream of about 4.5 s, longer than the idle time.
        paced = {
            **SIM_ENV,
            "CAPYCTL_SIM_GPU_BYTES": "16GiB",
            "CAPYCTL_SIM_TOKENS_PER_SECOND": "4",
            "CAPYCTL_SIM_COMPLETION_TOKENS": "18",
        }
        add_engine("paced-tf", kind="tensorfold", command=f"{SIM} tensorfold", env=paced)
        tf = deployment("tf", engine="paced-tf", idle_park_seconds=idle)
        actions.ensure_ready(tf.pk)
        return tf.pk, Host.objects.get().pk, issue_api_key("bob")[1]

    tf_id, host_id, key = await sync_to_async(set_up)()
    transport = httpx.ASGITransport(app=cast("Any", Gateway()))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", timeout=60,
        headers={"Authorization": f"Bearer {key}"},
    ) as client:  # fmt: skip
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": "tf", "messages": messages, "stream": True}
        stream = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        deadline = time.monotonic() + 60
        while requests_in_progress.count(tf_id) == 0:
            assert time.monotonic() < deadline, "the stream never reached its engine"
            await asyncio.sleep(0.02)
        began = time.monotonic()
        await asyncio.sleep(idle + 0.5)  # the idle time, counted from the request's start
        assert not stream.done(), "the stream ended before the idle time passed"
        await sync_to_async(reconcile.reconcile)(host_id)
        assert await sync_to_async(state)("tf") == ("ready", "")
        answer = await stream
        ended = time.monotonic()
    assert answer.status_code == 200, answer.text
    chunks = [line for line in answer.text.splitlines() if line.startswith("data: {")]
    assert answer.text.rstrip().endswith("data: [DONE]")
    assert len([c for c in chunks if '"content"' in c]) >= 18
    assert ended - began > idle

    def touched_at_the_end() -> bool:
        last = Deployment.objects.get(pk=tf_id).last_request_at
        return last is not None and time.time() - last.timestamp() < 1

    await sync_to_async(wait_until)(touched_at_the_end, "the stream's end noted")
    await sync_to_async(reconcile.reconcile)(host_id)  # idle for about a second, not `idle`
    assert await sync_to_async(state)("tf") == ("ready", "")


@pytest.mark.django_db(transaction=True)
async def test_starts_in_flight_leave_a_ready_model_answering(
    gpu24, bob, database_threads, tmp_path
):
    """Eight models whose engines take long to load, requested at once: their starts hold
    threads for as long as they load, and the gateway's own lookups (a new key, a route
    not yet cached) must still run, so a ready model answers meanwhile. Starts once ran on
    the threads those lookups use, and the ready model's request waited for a start."""
    from capyctl.access.services import issue_api_key
    from capyctl.gateway.app import Gateway

    gate = tmp_path / "loads-may-finish"
    small = {**SIM_ENV, "CAPYCTL_SIM_WEIGHTS_BYTES": "1GiB", "CAPYCTL_SIM_RESIDUAL_BYTES": "64MiB"}
    starting = [f"s{i}" for i in range(8)]

    def set_up() -> str:
        add_engine("quick", kind="vllm", command=f"{SIM} vllm", env=small)
        held = {**small, "CAPYCTL_SIM_LOAD_GATE": str(gate)}
        add_engine("held", kind="vllm", command=f"{SIM} vllm", env=held)
        ready = deployment("r", engine="quick", gib=2)
        for name in starting:
            deployment(name, engine="held", gib=2)
        actions.ensure_ready(ready.pk)
        return issue_api_key("bob")[1]

    def count_starting() -> int:
        return Deployment.objects.filter(name__in=starting, observed_state="starting").count()

    key = await sync_to_async(set_up)()
    transport = httpx.ASGITransport(app=cast("Any", Gateway()))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", timeout=120,
        headers={"Authorization": f"Bearer {key}"},
    ) as client:  # fmt: skip

        def chat(model: str):
            messages = [{"role": "user", "content": "hi"}]
            body = {"model": model, "messages": messages, "max_tokens": 1}
            return client.post("/v1/chat/completions", json=body)

        starts = [asyncio.ensure_future(chat(name)) for name in starting]
        try:
            deadline = time.monotonic() + 60
            while await sync_to_async(count_starting)() < len(starting):
                assert time.monotonic() < deadline, "the eight starts never all began"
                assert not any(s.done() for s in starts), [
                    s.result().text for s in starts if s.done()
                ]
                await asyncio.sleep(0.05)
            for _ in range(3):  # the first request's key and route are not cached yet
                # Not a speed check: without threads of their own the starts hold every
                # one, and this request waits until a load finishes (never: the gate is shut).
                answer = await asyncio.wait_for(chat("r"), timeout=15)
                assert answer.status_code == 200, answer.text
            assert not any(s.done() for s in starts)
        finally:
            gate.touch()  # the loads finish, and their threads with them
            answers = await asyncio.gather(*starts)
    assert [a.status_code for a in answers] == [200] * len(starting), [a.text for a in answers]


@pytest.mark.django_db(transaction=True)
def test_a_wake_promises_what_its_engine_was_launched_with(gpu24):
    """A parked model's claim lowered from 16 to 8 GiB: its sleeping engine still wakes to
    the 16 GiB it was started with, so the wake must promise 16 (making room for it), not
    8 (the ledger under-counted, and the probe's figure overshot the pool)."""
    from capyctl.deployments.services import get_deployment, spec_of, update_deployment

    vllm_engine()
    a, b = deployment("a"), deployment("b", gib=10)
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    assert state("a") == ("parked", "ram")
    spec = spec_of(get_deployment("a"))
    spec.gpu_memory_bytes = 8 * GIB
    update_deployment("a", spec)
    changed = Event.objects.filter(kind="deployment.changed", subject="a").latest("pk")
    assert changed.message == (
        "deployment a changed: gpu_memory_bytes; its engine keeps what it was started with "
        "until its next start"
    )
    actions.ensure_ready(a.pk)
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "ram")  # 16 + 10 GiB do not fit in 24
    assert (
        list(Event.objects.filter(kind="ledger.overshoot").values_list("message", flat=True)) == []
    )
    assert gpu_ledger_matches_probe(gpu24)
    actions.stop(a.pk)
    actions.start(a.pk)  # a new start takes the new claim
    assert abs(entries("a")["gpu0"][1] - 8 * GIB) < 16 * MIB


@pytest.mark.django_db(transaction=True)
def test_parked_copies_filling_host_ram_make_way_for_a_start(gpu24):
    """Host RAM almost full of parked copies: each start needs some host RAM for its
    engine, and parking frees only GPU memory, so every start was refused (no_capacity)
    while a parked copy sat in the RAM it needed. The least recently used copy now goes:
    its model is stopped, and the event says why."""
    vllm_engine()
    a, b, c, d = (deployment(name, gib=10, weights_bytes=8 * GIB) for name in "abcd")
    actions.ensure_ready(a.pk)
    actions.ensure_ready(b.pk)
    actions.ensure_ready(c.pk)  # a parks in RAM, its 8 GiB copy there
    assert state("a") == ("parked", "ram")
    # Host RAM left: b's 8 GiB copy and 256 MiB, less than an engine's own 512 MiB.
    host = Host.objects.get(name="local")
    ram = next(p for p in pool_usage(host) if p.pool == "ram")
    reserve = ram.reserve_bytes + ram.free_bytes - (8 * GIB + 256 * MIB)
    Host.objects.filter(pk=host.pk).update(ram_reserve_bytes=reserve)

    actions.ensure_ready(d.pk)  # b parks in RAM for it; then its engine needs RAM
    assert state("d") == ("ready", "")
    assert state("b") == ("parked", "ram")
    assert state("a") == ("stopped", "")
    assert entries("a") == {}
    stopped = Event.objects.get(kind="deployment.stopped", subject="a")
    assert re.fullmatch(
        r"stopped a \(parked\) to make room for d: its copy in host RAM \(8\.\d GiB\) is "
        r"needed for another engine",
        stopped.message,
    ), stopped.message
    assert overcommitted(Host.objects.get(name="local")) == []
    assert gpu_ledger_matches_probe(gpu24)


@pytest.mark.django_db(transaction=True)
def test_a_first_ram_park_never_promises_less_than_its_copy(gpu24):
    """Weights of unknown size: a first ``ram`` park promised half the claim (5 GiB of a
    10 GiB claim) for a copy that took 8 GiB, so the ledger counted 3 GiB less host RAM
    than the copy held, and the pool's reserve absorbed it (``ledger.overshoot``). The
    copy is now bounded by what the model holds on its GPUs, until a park measures it."""
    vllm_engine()
    a, b = deployment("a", gib=10), deployment("b", gib=16)
    actions.ensure_ready(a.pk)
    host = Host.objects.get(name="local")
    ram = next(p for p in pool_usage(host) if p.pool == "ram")
    # 6.5 GiB of host RAM left: room for half a's claim, not for its 8 GiB copy.
    reserve = ram.reserve_bytes + ram.free_bytes - (6 * GIB + 512 * MIB)
    Host.objects.filter(pk=host.pk).update(ram_reserve_bytes=reserve)

    actions.ensure_ready(b.pk)
    assert state("b") == ("ready", "")
    assert list(Event.objects.filter(kind="ledger.overshoot").values_list("message")) == []
    assert state("a") == ("parked", "deep")
    assert entries("a")["ram"][1] < GIB  # no copy kept, none counted
    assert overcommitted(Host.objects.get(name="local")) == []
