"""The dashboard at `/`: what it shows, who may see it, and how it stays live."""

import asyncio
import json
import time

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client

from capyctl.asgi import application
from capyctl.deployments.models import Deployment
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.events import services as event_services
from capyctl.events.models import Event
from capyctl.events.services import DASHBOARD_GROUP, record_event, tell_dashboards
from capyctl.hosts.models import Host
from capyctl.ledger.services import admit, host_lock, set_foreign, set_measured
from capyctl.scheduler import requests_in_progress
from capyctl.web import metrics
from capyctl.web.dashboard import dashboard_data, format_duration

GIB = 1024**3
MIB = 1024**2


@pytest.fixture
def gpu_box(db):
    """One host with a 24 GiB GPU (512 MiB kept in reserve) and 64 GiB of RAM (2 GiB)."""
    return Host.objects.create(
        name="local",
        is_local=True,
        state=Host.State.ONLINE,
        inventory={
            "probe": "simulated",
            "unified": False,
            "gpus": [{"index": 0, "name": "Sim GPU", "total_bytes": 24 * GIB}],
            "ram_total_bytes": 64 * GIB,
        },
        gpu_reserve_bytes=512 * MIB,
        ram_reserve_bytes=2 * GIB,
    )


@pytest.fixture
def two_models(gpu_box):
    """``chat`` holds 16 GiB of gpu0 (and 1 GiB of RAM); ``coder`` was promised 4 GiB."""
    add_engine("sim-vllm", kind="vllm", command="vllm")
    chat = add_deployment(
        DeploymentSpec(name="chat", engine="sim-vllm", source="chat", host="local")
    )
    coder = add_deployment(
        DeploymentSpec(name="coder", engine="sim-vllm", source="coder", host="local")
    )
    with host_lock(gpu_box.pk) as host:
        admit(host, chat.pk, {"gpu0": 16 * GIB, "ram": GIB})
        set_measured(host, chat.pk, {"gpu0": 16 * GIB, "ram": GIB})
        admit(host, coder.pk, {"gpu0": 4 * GIB})
        set_foreign(host, {"gpu0": GIB})
    Deployment.objects.filter(pk=chat.pk).update(observed_state="ready")
    Deployment.objects.filter(pk=coder.pk).update(observed_state="starting")
    return chat, coder


def _pool(data, host, pool):
    found = next(h for h in data["hosts"] if h["name"] == host)
    return next(p for p in found["pools"] if p["pool"] == pool)


def _model(data, name):
    return next(d for d in data["deployments"] if d["name"] == name)


# --- the data ----------------------------------------------------------------------------


def test_a_bar_splits_each_pool_by_deployment_and_status(two_models):
    data = dashboard_data()
    json.dumps(data)  # plain data, as the page and the socket send it

    gpu0 = _pool(data, "local", "gpu0")
    assert gpu0["capacity_bytes"] == 24 * GIB - 512 * MIB
    assert (gpu0["held_bytes"], gpu0["promised_bytes"], gpu0["foreign_bytes"]) == (
        16 * GIB,
        4 * GIB,
        GIB,
    )
    assert gpu0["free_bytes"] == gpu0["capacity_bytes"] - 21 * GIB
    segments = [(s["status"], s["deployment"], s["bytes"]) for s in gpu0["segments"]]
    assert segments == [
        ("held", "chat", 16 * GIB),
        ("promised", "coder", 4 * GIB),
        ("foreign", None, GIB),
        ("free", None, 3 * GIB - 512 * MIB),
    ]
    assert gpu0["segments"][0]["size"] == "16.0 GiB"
    assert sum(s["percent"] for s in gpu0["segments"]) == pytest.approx(100, abs=0.01)
    assert not gpu0["over"]

    ram = _pool(data, "local", "ram")
    assert ram["capacity_bytes"] == 62 * GIB
    assert [(s["status"], s["deployment"]) for s in ram["segments"]] == [
        ("held", "chat"),
        ("free", None),
    ]
    assert ram["free_bytes"] == 61 * GIB

    host = data["hosts"][0]
    assert (host["name"], host["state"], host["local"]) == ("local", "online", True)
    assert host["last_seen_at"] is None


def test_an_unconfirmed_entry_keeps_its_own_colour(two_models, gpu_box):
    chat, _ = two_models
    from capyctl.ledger.services import mark_unconfirmed

    mark_unconfirmed(gpu_box, chat.pk, "park timed out")
    gpu0 = _pool(dashboard_data(), "local", "gpu0")
    assert ("unconfirmed", "chat") in [(s["status"], s["deployment"]) for s in gpu0["segments"]]
    assert gpu0["unconfirmed_bytes"] == 16 * GIB
    assert gpu0["held_bytes"] == 0


def test_a_pool_counted_past_its_capacity_is_marked_over(gpu_box):
    with host_lock(gpu_box.pk) as host:
        set_foreign(host, {"gpu0": 30 * GIB})
    gpu0 = _pool(dashboard_data(), "local", "gpu0")
    assert gpu0["over"]
    assert gpu0["free_bytes"] < 0
    assert [s["status"] for s in gpu0["segments"]] == ["foreign"]
    assert gpu0["segments"][0]["percent"] == 100


def test_models_show_states_memory_queues_and_their_last_switch(two_models):
    chat, _ = two_models
    record_event("deployment.woke", "woke chat", subject="chat", deployment_id=chat.pk,
                 duration_ms=1850)  # fmt: skip
    record_event("deployment.changed", "chat changed", subject="chat", deployment_id=chat.pk)
    metrics.NOW.waiting["coder"] = 3
    assert requests_in_progress.begin(chat.pk)
    try:
        data = dashboard_data()
    finally:
        requests_in_progress.end(chat.pk)
        del metrics.NOW.waiting["coder"]

    shown = _model(data, "chat")
    assert (shown["observed_state"], shown["desired_state"], shown["host"], shown["engine"]) == (
        "ready",
        "running",
        "local",
        "sim-vllm",
    )
    assert shown["memory"] == [
        {"host": "local", "pool": "gpu0", "status": "held", "bytes": 16 * GIB, "size": "16.0 GiB"},
        {"host": "local", "pool": "ram", "status": "held", "bytes": GIB, "size": "1.0 GiB"},
    ]
    assert (shown["in_flight"], shown["waiting"]) == (1, 0)
    # The newest switch step, not the newest event: a change of settings is no switch.
    assert shown["last_switch"]["step"] == "wake"
    assert shown["last_switch"]["duration_ms"] == 1850
    assert shown["last_switch"]["took"] == "1.9 s"
    assert shown["last_switch"]["at"]

    other = _model(data, "coder")
    assert other["observed_state"] == "starting"
    assert [(m["pool"], m["status"]) for m in other["memory"]] == [("gpu0", "promised")]
    assert (other["in_flight"], other["waiting"]) == (0, 3)
    assert other["last_switch"] is None


def test_the_newest_thirty_events_newest_first(two_models):
    for n in range(35):
        record_event("key.created", f"key {n}", subject="bob", actor="alice")
    events = dashboard_data()["events"]
    assert len(events) == 30
    assert events[0]["message"] == "key 34"
    assert set(events[0]) >= {"at", "level", "kind", "subject", "message", "actor", "duration_ms"}
    assert (events[0]["kind"], events[0]["actor"], events[0]["level"]) == (
        "key.created",
        "alice",
        "info",
    )


def test_the_data_takes_a_few_queries_whatever_the_number_of_models(
    two_models, django_assert_max_num_queries
):
    from capyctl.deployments.adapters import add_adapter

    for n in range(10):
        add_deployment(DeploymentSpec(name=f"extra{n}", engine="sim-vllm", source="m",
                                      adapter_slots=2))  # fmt: skip
        add_adapter(f"tune{n}", f"extra{n}", f"/srv/loras/tune{n}")
    # The page's rows, the hosts, the ledger, the events, the waits for room, the
    # timeline's two reads, and the adapters with the engines that hold them.
    with django_assert_max_num_queries(10):
        dashboard_data()


def test_durations_read_like_people_say_them():
    assert format_duration(None) == ""
    assert format_duration(850) == "850 ms"
    assert format_duration(12_400) == "12.4 s"
    assert format_duration(185_000) == "3 min 5 s"


# --- the page ----------------------------------------------------------------------------


def test_anonymous_visitors_are_sent_to_log_in(client, db):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/login/?next=/"


def test_users_who_are_not_staff_go_to_their_keys(client, bob):
    client.force_login(bob)
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/keys/"


def test_staff_see_the_whole_picture_without_javascript(client, alice, two_models):
    client.force_login(alice)
    response = client.get("/")
    assert response.status_code == 200
    html = response.content.decode()
    assert '<tr data-deployment="chat" data-state="ready">' in html
    assert '<td class="state state-ready">ready</td>' in html
    assert 'data-pool="gpu0"' in html
    assert "this machine · probe simulated · measures per process" in html
    assert 'title="chat: 16.0 GiB held"' in html
    assert 'title="coder: 4.0 GiB promised"' in html
    assert 'id="dashboard-data"' in html
    assert "capyctl/dashboard.js" in html
    assert response.context["nav"] == "dashboard"
    assert response.context["data"]["deployments"][0]["name"] == "chat"


def test_the_page_says_since_when_redis_does_not_answer(client, alice, settings):
    """Server mode with its Redis away: the dashboard said nothing of it."""
    from capyctl import controlplane

    client.force_login(alice)
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    controlplane.note_outage(True, "ConnectionError: refused")
    since = Event.objects.get(kind="redis.down").created_at.isoformat()
    html = client.get("/").content.decode()
    banner = html.split('id="control-plane"')[1].split("</p>")[0]
    assert " hidden" not in banner.split(">")[0]
    assert f'Redis does not answer since <time datetime="{since}">' in banner
    settings.REDIS_URL = None  # standalone: nothing to say
    html = client.get("/").content.decode()
    assert 'id="control-plane" class="card control-plane" role="status" hidden>' in html


# --- the live feed -----------------------------------------------------------------------


def _session_cookie(user):
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def _socket(session_key=None):
    headers = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    if session_key:
        headers.append((b"cookie", f"sessionid={session_key}".encode()))
    return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)


async def _closed_with(communicator, timeout=5):
    message = await communicator.receive_output(timeout=timeout)
    assert message["type"] == "websocket.close", message
    return message.get("code")


async def _snapshot_where(communicator, check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "no snapshot with the change arrived in time"
        message = await communicator.receive_json_from(timeout=left)
        assert message["type"] == "snapshot"
        if check(message["data"]):
            return message["data"]


@pytest.mark.django_db(transaction=True)
async def test_the_feed_refuses_anonymous_visitors_and_ordinary_users(bob):
    anonymous = _socket()
    connected, _ = await anonymous.connect()
    assert connected
    assert await _closed_with(anonymous) == 4403
    await anonymous.disconnect()

    ordinary = _socket(await database_sync_to_async(_session_cookie)(bob))
    await ordinary.connect()
    assert await _closed_with(ordinary) == 4403
    await ordinary.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_staff_get_a_snapshot_then_each_change(alice, two_models):
    chat, _ = two_models
    socket = _socket(await database_sync_to_async(_session_cookie)(alice))
    connected, _ = await socket.connect()
    assert connected
    first = await socket.receive_json_from(timeout=5)
    assert first["type"] == "snapshot"
    assert _model(first["data"], "chat")["observed_state"] == "ready"

    def park_chat():
        Deployment.objects.filter(pk=chat.pk).update(observed_state="parked", parked_mode="ram")
        record_event("deployment.parked", "parked chat", subject="chat", deployment_id=chat.pk,
                     duration_ms=900)  # fmt: skip

    await database_sync_to_async(park_chat)()
    data = await _snapshot_where(
        socket, lambda data: _model(data, "chat")["observed_state"] == "parked"
    )
    assert _model(data, "chat")["parked_mode"] == "ram"
    assert _model(data, "chat")["last_switch"]["step"] == "park"
    assert data["events"][0]["kind"] == "deployment.parked"

    # Nothing changed: nothing is sent, though the feed re-reads every second.
    assert await socket.receive_nothing(timeout=2.5, interval=0.1)
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_deactivated_user_is_cut_off_at_the_next_event(alice, two_models):
    socket = _socket(await database_sync_to_async(_session_cookie)(alice))
    await socket.connect()
    assert (await socket.receive_json_from(timeout=5))["type"] == "snapshot"

    def deactivate():
        User.objects.filter(pk=alice.pk).update(is_active=False)
        record_event("user.changed", "alice deactivated", subject="alice")

    await database_sync_to_async(deactivate)()
    assert await _closed_with(socket) == 4403
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["loses staff status", "changes password"])
async def test_a_user_who_loses_staff_status_or_changes_password_is_cut_off(
    alice, two_models, change
):
    socket = _socket(await database_sync_to_async(_session_cookie)(alice))
    await socket.connect()
    assert (await socket.receive_json_from(timeout=5))["type"] == "snapshot"

    def apply_change():
        user = User.objects.get(pk=alice.pk)
        if change == "loses staff status":
            user.is_staff = False
        else:  # elsewhere (the admin, another browser): this session's hash no longer matches
            user.set_password("alice-password-2")
        user.save()

    await database_sync_to_async(apply_change)()
    # No event rings the feed: its own check, once a second, finds the change.
    assert await _closed_with(socket) == 4403
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_logging_out_elsewhere_closes_the_feed(alice, two_models):
    session = await database_sync_to_async(_session_cookie)(alice)
    socket = _socket(session)
    await socket.connect()
    assert (await socket.receive_json_from(timeout=5))["type"] == "snapshot"

    def log_out():
        from django.contrib.sessions.models import Session

        Session.objects.filter(session_key=session).delete()

    await database_sync_to_async(log_out)()
    assert await _closed_with(socket) == 4403
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_recording_an_event_rings_the_dashboard_group_from_any_thread(gpu_box):
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(DASHBOARD_GROUP, channel)
    event_services.dashboards_listen_on(asyncio.get_running_loop())
    try:

        def from_a_scheduler_thread():
            try:
                record_event("host.online", "local answers", subject="local")
            finally:
                connection.close()

        # A plain worker thread (as the scheduler's), not one asgiref started.
        await asyncio.to_thread(from_a_scheduler_thread)
        message = await asyncio.wait_for(layer.receive(channel), timeout=2)
        assert message == {"type": "dashboard.changed"}

        # From asgiref's threads (views, consumers) too.
        await database_sync_to_async(record_event)("host.online", "again", subject="local")
        message = await asyncio.wait_for(layer.receive(channel), timeout=2)
        assert message == {"type": "dashboard.changed"}
        assert await database_sync_to_async(Event.objects.count)() == 2
    finally:
        await layer.group_discard(DASHBOARD_GROUP, channel)


async def test_telling_dashboards_never_fails_its_caller(monkeypatch):
    tell_dashboards()  # on an event loop's thread: skipped, no error

    def broken_layer():
        raise RuntimeError("layer down")

    monkeypatch.setattr(event_services, "get_channel_layer", broken_layer)
    await asyncio.to_thread(tell_dashboards)
