"""Replicas: one model served by several engines, each on GPUs of its own, routed by
load and affinity, one more brought up when the ready ones are busy (docs/replicas.md)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from dataclasses import replace
from typing import Any, cast
from unittest import mock

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db.models import Q
from prometheus_client import generate_latest

from capyctl.deployments.models import Deployment
from capyctl.deployments.services import (
    get_deployment,
    remove_deployment,
    spec_of,
    update_deployment,
)
from capyctl.engines.services import add_engine
from capyctl.errors import NotFoundError, UserError
from capyctl.events.models import Event
from capyctl.scheduler import actions, replica_scaling, requests_in_progress, scaling, wakes
from capyctl.scheduler.drivers import set_local_driver
from capyctl.web.metrics import REGISTRY
from hostagent.simgpu import SimSpec
from tests.scheduling import GIB, SIM, SIM_ENV, deployment, make_host, state


@pytest.fixture
def two_gpus(tmp_path, settings):
    """A simulated host of two 24 GiB GPUs whose engines run as children of this test."""
    driver = make_host(tmp_path, settings, SimSpec(unified=False, sizes=[24 * GIB, 24 * GIB]))
    yield driver
    driver.stop_all(grace_seconds=2)
    set_local_driver(None)


def _rows(name: str) -> list[tuple[str, int, int]]:
    first = Deployment.objects.get(name=name)
    rows = Deployment.objects.filter(replica_of=first).order_by("replica_index")
    return [(r.name, r.replica_index, r.priority) for r in [first, *rows]]


@pytest.mark.django_db
def test_a_deployment_of_three_replicas_is_three_rows_kept_in_step(two_gpus):
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    deployment("chat", replicas=3, priority=5)
    assert _rows("chat") == [("chat", 0, 5), ("chat~1", 1, 5), ("chat~2", 2, 5)]
    # People name the deployment, never a replica row: it is not one of theirs.
    with pytest.raises(NotFoundError):
        get_deployment("chat~1")

    update_deployment("chat", replace(spec_of(get_deployment("chat")), replicas=2, priority=7))
    assert _rows("chat") == [("chat", 0, 7), ("chat~1", 1, 7)]
    update_deployment("chat", replace(spec_of(get_deployment("chat")), name="talk"))
    assert _rows("talk") == [("talk", 0, 7), ("talk~1", 1, 7)]

    remove_deployment("talk")
    assert not Deployment.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_replicas_run_on_gpus_of_their_own_and_a_running_one_is_not_dropped(two_gpus, cli):
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    first = deployment("chat", replicas=2)
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(first.pk)
    actions.ensure_ready(second.pk)
    gpus = {
        row.name: tuple(row.instances.exclude(state="exited").get().gpu_indices)
        for row in (first, second)
    }
    assert sorted(gpus.values()) == [(0,), (1,)], gpus  # each a GPU of its own
    shown = cli("status").out.splitlines()
    lines = [line.split()[:5] for line in shown if line.startswith("chat")]
    # A line for each replica, its GPUs beside its host.
    assert sorted(lines) == [[name, "sim-vllm", f"local/{gpus[name][0]}", "running", "ready"]
                             for name in ("chat", "chat~1")]  # fmt: skip
    listed = cli("deployment", "list").out.splitlines()
    assert listed[0].split()[6] == "REPLICAS"
    assert listed[1].split()[6] == "2/2"
    # --json: each replica's host, GPUs and state; its requests in flight are known only
    # to the serving process (a command line beside standalone says null).
    with mock.patch.object(requests_in_progress, "_serving", False):  # a command line
        (shown,) = json.loads(cli("deployment", "list", "--json").out)
    assert [(r["name"], r["host"], r["observed_state"], r["in_flight"])
            for r in shown["replica_set"]] == [("chat", "local", "ready", None),
                                               ("chat~1", "local", "ready", None)]  # fmt: skip
    assert sorted(r["gpus"] for r in shown["replica_set"]) == [[0], [1]]
    assert requests_in_progress.begin(first.pk)
    try:
        assert [r["in_flight"] for r in replica_data_of("chat", serving=True)] == [1, 0]
    finally:
        requests_in_progress.end(first.pk)
    scraped = generate_latest(REGISTRY).decode()
    assert 'capyctl_replicas{model="chat",state="ready"} 2.0' in scraped

    before = _rows("chat")
    lowering = (r"^cannot lower chat's replicas to 1: its replica chat~1 is ready; stop chat "
                r"first, then lower them$")  # fmt: skip
    with pytest.raises(UserError, match=lowering):
        update_deployment("chat", replace(spec_of(get_deployment("chat")), replicas=1))
    assert _rows("chat") == before  # nothing changed
    actions.stop(first.pk)  # the first alone
    with pytest.raises(UserError, match=r"^its replica chat~1 is ready; stop chat first$"):
        remove_deployment("chat")
    assert state("chat~1") == ("ready", "")


def _two_ready() -> str:
    """A model `chat` of two replicas, both ready; a key for bob."""
    from capyctl.access.services import issue_api_key

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    first = deployment("chat", replicas=2)
    actions.ensure_ready(first.pk)
    actions.ensure_ready(Deployment.objects.get(name="chat~1").pk)
    return issue_api_key("bob")[1]


def _one_ready_one_parked(gate: Any, **settings: int) -> str:
    """A model `chat` of ``--replicas 1:2`` (and ``settings``) whose engines hold each
    request while ``gate`` is missing: its first replica ready, its second parked in RAM;
    a key for bob."""
    from capyctl.access.services import issue_api_key

    env = {**SIM_ENV, "CAPYCTL_SIM_REQUEST_GATE": str(gate)}
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=env)
    first = deployment("chat", replicas=2, min_replicas=1, **settings)
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(second.pk)
    actions.park(second.pk, "ram")
    actions.ensure_ready(first.pk)
    return issue_api_key("bob")[1]


def _client(gateway: Any, key: str) -> httpx.AsyncClient:
    """A client of the in-process gateway with ``key``."""
    transport = httpx.ASGITransport(app=cast("Any", gateway))
    return httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60,
                             headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def replica_data_of(name: str, *, serving: bool) -> list[dict[str, Any]]:
    """``replica_set`` as the process serving /v1 reports it (REST, the dashboard)."""
    from capyctl.reports import deployment_data

    with mock.patch.object(requests_in_progress, "_serving", serving):
        return list(deployment_data(Deployment.objects.get(name=name))["replica_set"])


def _replica_of(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "chat"  # each engine serves the model's own name
    return answer.headers["x-capyctl-replica"]


@pytest.mark.django_db(transaction=True)
async def test_requests_spread_over_ready_replicas_and_a_session_keeps_its_own(
    two_gpus, bob, database_threads
):
    """Two ready replicas: requests of other prompts go to either (by the prompt's start,
    on a ring of both), each answer naming its replica's host and GPU; the same prompt, or
    one session whatever its prompts, goes to the same replica (its prefix cache)."""
    from capyctl.gateway.app import Gateway

    key = await sync_to_async(_two_ready)()
    gateway = Gateway()
    async with _client(gateway, key) as client:

        async def chat(prompt: str, **headers: str) -> httpx.Response:
            body = {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 1}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body, headers=headers)

        served = Counter([_replica_of(await chat(f"question {i}")) for i in range(16)])
        assert set(served) == {"local/0", "local/1"}, served
        assert len({_replica_of(await chat("the same question")) for _ in range(4)}) == 1
        session = {_replica_of(await chat(f"turn {i}", **{"x-session-id": "s-1"}))
                   for i in range(6)}  # fmt: skip
        assert len(session) == 1

        # --routing least-load: no affinity, the same prompt goes to each in turn.
        def least_load() -> None:
            spec = spec_of(get_deployment("chat"))
            update_deployment("chat", replace(spec, routing="least-load"))

        await sync_to_async(least_load)()
        await asyncio.sleep(0.3)  # the routes are read again within a quarter second
        assert len({_replica_of(await chat("the same question")) for _ in range(4)}) == 2
        # A replica's own row name is no model a client may name.
        body = {"model": "chat~1", "messages": [{"role": "user", "content": "hi"}]}
        direct = await client.post("/v1/chat/completions", json=body)
        assert direct.status_code == 404, direct.text
        assert direct.json()["error"]["code"] == "model_not_found"
        assert "x-capyctl-replica" not in direct.headers
    await gateway.close()


@pytest.mark.django_db(transaction=True)
async def test_busy_replicas_bring_one_more_up_waking_a_parked_one(
    two_gpus, bob, database_threads, tmp_path
):
    """``--replicas 1:2``, target_concurrency 1: two requests held in flight on the one
    ready replica call for one more, and the parked replica is woken (an event says why,
    with its figures), while the requests go on; the next request goes to the replica
    that came up."""
    from capyctl.gateway.app import Gateway

    gate = tmp_path / "requests-may-finish"
    gate.touch()  # open while the engines start (their start asks them once)

    key = await sync_to_async(_one_ready_one_parked)(gate, target_concurrency=1)
    # The copy its ram park measured sizes the other replica's first ram park too.
    measured = {
        row.name: row.measured_weights_bytes
        async for row in Deployment.objects.filter(name__startswith="chat")
    }
    assert measured["chat"] == measured["chat~1"] is not None, measured
    gateway = Gateway()
    async with _client(gateway, key) as client:

        async def chat(prompt: str = "hi") -> httpx.Response:
            body = {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 1}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body)

        gate.unlink()  # requests are held in the engine from now on
        held = [asyncio.ensure_future(chat()) for _ in range(2)]
        try:
            deadline = time.monotonic() + 30
            while await sync_to_async(state)("chat~1") != ("ready", ""):
                assert time.monotonic() < deadline, "the parked replica was not woken"
                assert not any(h.done() for h in held), [h.result().text for h in held]
                await asyncio.sleep(0.05)
        finally:
            gate.touch()
        first = {_replica_of(await h) for h in held}
        assert len(first) == 1  # both on the replica that was ready
        scaled = await Event.objects.filter(kind="deployment.scaled").aget()
        assert scaled.subject == "chat"
        assert "requests in flight on average (over target_concurrency 1)" in scaled.message
        assert "waking parked replica" in scaled.message
        assert scaled.data["target_concurrency"] == 1
        await asyncio.sleep(0.3)  # the routes are read again within a quarter second
        # Other prompts: the replica that came up takes its share.
        answers = await asyncio.gather(*(chat(f"question {i}") for i in range(8)))
        assert {_replica_of(answer) for answer in answers} == {"local/0", "local/1"}
        scraped = (await sync_to_async(generate_latest)(REGISTRY)).decode()
        for replica in ("chat", "chat~1"):  # each replica's requests, and in flight now
            assert f'capyctl_replica_requests_total{{model="chat",replica="{replica}"}}' in scraped
        assert 'capyctl_replica_in_flight{model="chat",replica="chat~1"} 0.0' in scraped
    await gateway.close()


@pytest.mark.django_db
def test_the_admin_sets_replicas_and_lists_deployments_only(client, alice, two_gpus):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    engine = add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    form = {"name": "chat", "engine": engine.pk, "source": "chat", "gpu_memory": "16GiB",
            "gpus": 1, "park": "auto", "priority": 0, "replicas": 2}  # fmt: skip
    created = client.post("/admin/deployments/deployment/add/", form)
    assert created.status_code == 302, created.content.decode()[:2000]
    assert _rows("chat") == [("chat", 0, 0), ("chat~1", 1, 0)]
    listed = client.get("/admin/deployments/deployment/").content.decode()
    assert ">chat<" in listed
    assert "chat~1" not in listed


@pytest.mark.django_db(transaction=True)
async def test_a_replica_whose_engine_died_is_passed_over_before_the_first_byte(
    two_gpus, bob, database_threads
):
    """A session's replica has its engine killed: its next request, which the engine
    never answers, is sent to the other replica (200, that replica named), and the dead
    one takes no more requests while the scheduler still has it ready."""
    from capyctl.gateway.app import Gateway

    def kill_engine_on(label: str) -> None:
        gpu = int(label.rsplit("/", 1)[1])
        for row in Deployment.objects.filter(Q(name="chat") | Q(replica_of__name="chat")):
            instance = row.instances.exclude(state="exited").get()
            if list(instance.gpu_indices) == [gpu]:
                os.kill(int(instance.pid or 0), signal.SIGKILL)
                return
        raise AssertionError(f"no engine on {label}")

    key = await sync_to_async(_two_ready)()
    gateway = Gateway()
    async with _client(gateway, key) as client:

        async def chat(prompt: str) -> httpx.Response:
            body = {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 1}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body,
                                     headers={"x-session-id": "s-1"})  # fmt: skip

        before = _replica_of(await chat("first"))
        await sync_to_async(kill_engine_on)(before)
        after = [_replica_of(await chat(f"turn {i}")) for i in range(3)]
        assert set(after) == {"local/0", "local/1"} - {before}
    await gateway.close()


@pytest.mark.django_db(transaction=True)
def test_the_replicas_pass_keeps_fixed_replicas_up_and_parks_idle_ones_past_the_minimum(
    two_gpus, database_threads
):
    """``--replicas 2`` keeps both up while the model serves: once the first is ready, the
    pass starts the second (an event says why). As ``1:2`` with ``idle_park_seconds``, an
    idle replica past the minimum is parked, the most recently started; the first stays."""
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    first = deployment("chat", replicas=2)
    second = Deployment.objects.get(name="chat~1")

    def scale() -> scaling.Step | None:
        return replica_scaling.scale(Deployment.objects.get(pk=first.pk), wakes.ready_later)

    assert scale() is None  # asleep
    actions.ensure_ready(first.pk)
    step = scale()
    assert step is not None
    assert (step.action, step.replica_id) == ("start", second.pk)
    deadline = time.monotonic() + 30
    while state("chat~1") != ("ready", ""):  # brought up in the background
        assert time.monotonic() < deadline, state("chat~1")
        time.sleep(0.05)
    event = Event.objects.get(kind="deployment.scaled")
    assert event.message == (
        f"chat: 1 of 2..2 replicas up, under the minimum 2: starting stopped replica {second.pk}"
    )
    assert scale() is None  # both up

    update_deployment("chat", replace(spec_of(get_deployment("chat")), min_replicas=1,
                                      idle_park_seconds=1))  # fmt: skip
    time.sleep(1.1)
    step = scale()
    assert step is not None
    assert (step.action, step.replica_id) == ("park", second.pk)  # the later one started
    assert state("chat~1")[0] == "parked"
    assert state("chat") == ("ready", "")
    parked = Event.objects.filter(kind="deployment.scaled").first()
    assert parked is not None
    assert "parking replica" in parked.message


@pytest.mark.django_db(transaction=True)
def test_an_idle_replica_is_not_parked_on_its_own_while_another_serves(two_gpus):
    """The reconcile pass parks a model of several replicas as a whole: not one idle
    replica of it while another has a request in flight."""
    from capyctl.scheduler import requests_in_progress
    from capyctl.scheduler.reconcile import reconcile

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    first = deployment("chat", replicas=2, idle_park_seconds=1)
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(first.pk)
    actions.ensure_ready(second.pk)
    host_id = int(Deployment.objects.get(pk=first.pk).host_id or 0)
    time.sleep(1.1)
    assert requests_in_progress.begin(first.pk)
    try:
        reconcile(host_id)
        assert state("chat~1") == ("ready", "")
    finally:
        requests_in_progress.end(first.pk)
    time.sleep(1.1)
    reconcile(host_id)
    assert state("chat")[0] == "parked"
    assert state("chat~1")[0] == "parked"


@pytest.mark.django_db(transaction=True)
async def test_a_request_waiting_past_scale_up_wait_brings_one_more_up(
    two_gpus, bob, database_threads, tmp_path
):
    """``--replicas 1:2 --scale-up-wait-seconds 1``: a streamed request held by the engine
    for more than a second, its answer not begun, calls for one more replica at the next
    request's arrival, whatever the load's average; the event says how long it waited.
    (A non-streamed answer's head comes once it is all generated: its wait cannot be told
    from its work, and does not count.)"""
    from capyctl.gateway.app import Gateway

    gate = tmp_path / "requests-may-finish"
    gate.touch()

    key = await sync_to_async(_one_ready_one_parked)(
        gate, target_concurrency=100, scale_up_wait_seconds=1
    )
    gateway = Gateway()
    async with _client(gateway, key) as client:

        async def chat(prompt: str) -> httpx.Response:
            body = {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 1, "stream": True}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body)

        gate.unlink()
        held = [asyncio.ensure_future(chat("first"))]
        try:
            await asyncio.sleep(0.5)
            held.append(asyncio.ensure_future(chat("second")))  # 0.5 s: not yet
            await asyncio.sleep(0.3)
            assert await sync_to_async(state)("chat~1") == ("parked", "ram")
            await asyncio.sleep(0.5)
            held.append(asyncio.ensure_future(chat("third")))  # the first waited 1.3 s
            deadline = time.monotonic() + 30
            while await sync_to_async(state)("chat~1") != ("ready", ""):
                assert time.monotonic() < deadline, "the parked replica was not woken"
                await asyncio.sleep(0.05)
        finally:
            gate.touch()
        for answer in held:
            streamed = await answer
            assert streamed.status_code == 200, streamed.text
            assert "x-capyctl-replica" in streamed.headers
        scaled = await Event.objects.filter(kind="deployment.scaled").aget()
        assert "over scale_up_wait_seconds 1 s" in scaled.message, scaled.message
        assert "waking parked replica" in scaled.message
    await gateway.close()


def test_replicas_are_given_as_n_or_min_max_on_the_command_line(cli, db):
    """``--replicas 1:3`` (scaled by load) or ``3`` (kept up); a minimum past the
    maximum is refused in one line, and changes nothing."""
    cli("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm")
    cli("deployment", "add", "chat", "--engine", "sim", "--source", "chat", "--gpu-memory",
        "16GiB", "--replicas", "1:3")  # fmt: skip
    chat = get_deployment("chat")
    assert (chat.min_replicas, chat.replicas, chat.kept_up) == (1, 3, 1)
    assert cli("deployment", "list").out.splitlines()[1].split()[6] == "0/1:3"
    refused = cli("deployment", "scale", "chat", "3:2")
    assert refused.code == 2
    assert refused.err.strip().endswith("'3:2': 3 is more than 2"), refused.err
    assert cli("deployment", "scale", "chat", "2").out == "deployment chat: 1:3 -> 2 replicas\n"
    chat = get_deployment("chat")
    assert (chat.min_replicas, chat.replicas, chat.kept_up) == (0, 2, 2)
    assert cli("deployment", "list").out.splitlines()[1].split()[6] == "0/2"


def _pid(name: str) -> int:
    row = Deployment.objects.get(name=name)
    return int(row.instances.exclude(state="exited").get().pid or 0)


@pytest.mark.django_db(transaction=True)
def test_a_rolling_restart_brings_a_spare_up_first_and_restarts_one_at_a_time(two_gpus):
    """``1:2`` with its second replica parked: a rolling restart wakes the parked one
    before the ready one goes (so one is always ready), then restarts each in turn (new
    engine processes); all at once, both go and come back; a model of one replica says
    it had none ready meanwhile."""
    from capyctl.scheduler import restarts

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    first = deployment("chat", replicas=2, min_replicas=1)
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(second.pk)
    actions.park(second.pk, "ram")
    actions.ensure_ready(first.pk)
    before = {name: _pid(name) for name in ("chat", "chat~1")}

    said = restarts.restart(first.pk, rolling=True, actor="test")
    assert said == "chat restarted (one replica at a time): chat, chat~1"
    # The spare woken for chat's restart was then restarted in its turn: both are new.
    assert (state("chat"), state("chat~1")) == (("ready", ""), ("ready", ""))
    assert all(_pid(name) != pid for name, pid in before.items())
    steps = [
        (e.kind, e.subject)
        for e in Event.objects.filter(
            kind__in=("deployment.woke", "deployment.stopped", "deployment.ready")
        ).order_by("created_at", "id")
    ]
    woke, stopped = (
        steps.index(("deployment.woke", "chat~1")),
        steps.index(("deployment.stopped", "chat")),
    )
    assert woke < stopped, steps  # the spare was ready before the first went

    together = restarts.restart(first.pk, rolling=False, actor="test")
    assert together == "chat restarted (all at once): chat, chat~1"
    assert (state("chat"), state("chat~1")) == (("ready", ""), ("ready", ""))
    actions.stop(first.pk)
    actions.stop(second.pk)
    update_deployment("chat", replace(spec_of(get_deployment("chat")), replicas=1,
                                      min_replicas=0))  # fmt: skip
    actions.start(first.pk)
    said = restarts.restart(first.pk, rolling=True, actor="test")
    assert said == (
        "chat restarted (its only replica): chat; 0 of the 1 it keeps up ready while chat "
        "restarted (it has one replica)"
    )


def test_restart_takes_rolling_and_nothing_else(cli, db):
    cli("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm")
    cli("deployment", "add", "chat", "--engine", "sim", "--source", "chat", "--gpu-memory",
        "16GiB")  # fmt: skip
    refused = cli("deployment", "restart", "chat", "--rolling")
    assert refused.code == 2
    assert refused.err == (
        "capyctl: error: cannot restart chat: no CapyCTL server is running on this data dir "
        "(start one with 'capyctl start standalone' or 'capyctl start server')\n"
    )
    assert cli("deployment", "restart", "chat", "--mode", "ram").code == 2


def _ready_route(pk: int, gpu: int) -> Any:
    from capyctl.gateway.routing import Route

    return Route(
        deployment_id=pk, name="chat" if pk == 1 else f"chat~{pk - 1}", desired_state="running",
        observed_state="ready", parked_mode="", host="local",
        base_url=f"http://127.0.0.1:{9000 + pk}", tls_name=None, host_state="online",
        launch_key="k", max_waiting=8, max_queue_seconds=30, ceilings=(),
        media_domains=frozenset(), gpus=(gpu,),
    )  # fmt: skip


async def test_server_mode_routes_on_every_api_process_s_requests_in_flight(
    redis_url, settings, monkeypatch
):
    """Another API process carries three requests on one replica: once this process has
    read Redis's counts, its requests go to the other replica; while Redis cannot be
    read, the counts last read stand."""
    from capyctl.gateway.replicas import Replicas
    from capyctl.scheduler.requests_in_progress import CountsUnknown, RedisInFlight
    from tests.test_requests_in_progress import in_use

    settings.REDIS_URL = in_use(redis_url)
    ours, theirs = RedisInFlight(redis_url), RedisInFlight(redis_url)  # two API processes
    monkeypatch.setattr(requests_in_progress, "_tracker", ours)
    first, second = _ready_route(1, 0), _ready_route(2, 1)
    group = replace(first, replicas=(first, second))
    try:
        replicas = Replicas(shared=True)
        assert {replicas.choose(group, None).deployment_id for _ in range(4)} == {1, 2}
        for _ in range(3):
            assert theirs.begin(1)
        await replicas.read_shared(group)
        assert replicas.others == {1: 3, 2: 0}
        assert {replicas.choose(group, None).deployment_id for _ in range(4)} == {2}

        def unknown(pk: int) -> int:
            raise CountsUnknown("Redis did not answer lately")

        monkeypatch.setattr(requests_in_progress, "count", unknown)
        await replicas.read_shared(group)
        assert replicas.others == {1: 3, 2: 0}  # as last read
    finally:
        ours.stop()
        theirs.stop()


@pytest.mark.django_db(transaction=True)
def test_an_idle_model_is_not_brought_back_up_to_its_kept_replicas(two_gpus, database_threads):
    """``--replicas 2`` with ``idle_park_seconds``: once every replica up has been idle that
    long (one already parked for it), the pass brings none up again; the model parks as a
    whole."""
    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    first = deployment("chat", replicas=2, idle_park_seconds=1)
    second = Deployment.objects.get(name="chat~1")
    actions.ensure_ready(second.pk)
    actions.park(second.pk, "ram")
    actions.ensure_ready(first.pk)
    assert replica_scaling.scale(Deployment.objects.get(pk=first.pk), wakes.ready_later)
    deadline = time.monotonic() + 30
    while state("chat~1") != ("ready", ""):  # not idle yet: the second is brought up
        assert time.monotonic() < deadline, state("chat~1")
        time.sleep(0.05)
    actions.park(second.pk, "ram")
    time.sleep(1.1)
    assert replica_scaling.scale(Deployment.objects.get(pk=first.pk), _fail) is None


def _fail(deployment_id: int) -> None:
    raise AssertionError(f"deployment {deployment_id} brought up")
