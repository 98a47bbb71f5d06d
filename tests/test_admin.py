"""The admin's own paths: keys made there (shown once), hosts added with a join token,
and start/stop/park/wake actions handed to the scheduler."""

from __future__ import annotations

import re

import pytest
from django.utils import timezone

from capyctl.access.models import ApiKey
from capyctl.access.services import find_api_key
from capyctl.deployments.models import Deployment
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.hosts.models import Host
from capyctl.scheduler.models import Operation

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client, alice):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    return client


def test_a_key_made_in_the_admin_is_shown_once_and_works(admin_client, bob):
    add_engine("sim", kind="vllm", command="python -m hostagent.sim vllm")
    llama = add_deployment(DeploymentSpec(name="llama", engine="sim", source="/m/llama"))
    page = admin_client.post(
        "/admin/access/apikey/add/",
        {
            "user": bob.pk,
            "name": "for bob",
            "allowed_models": [llama.pk],
            "requests_per_minute": 10,
        },
    )
    assert page.status_code == 200
    (full,) = re.findall(r"capy_[a-z0-9]+_[A-Za-z0-9_-]+", page.content.decode())
    key = find_api_key(full)
    assert key is not None
    assert (key.user.username, key.name, key.requests_per_minute) == ("bob", "for bob", 10)
    assert [d.name for d in key.allowed_models.all()] == ["llama"]
    listing = admin_client.get("/admin/access/apikey/").content.decode()
    assert key.prefix in listing
    assert full not in listing
    assert full not in admin_client.get(f"/admin/access/apikey/{key.pk}/change/").content.decode()


def test_the_admin_refuses_an_admin_scope_for_a_non_staff_user(admin_client, bob):
    refused = admin_client.post("/admin/access/apikey/add/", {"user": bob.pk, "is_admin": "on"})
    assert refused.status_code == 200
    assert "user &#x27;bob&#x27; is not staff" in refused.content.decode()
    past = admin_client.post(
        "/admin/access/apikey/add/",
        {"user": bob.pk, "expires_at_0": "2001-01-01", "expires_at_1": "00:00:00"},
    )
    assert "the expiry must be in the future" in past.content.decode()
    assert not ApiKey.objects.exists()


def test_a_host_added_in_the_admin_gets_its_join_token(admin_client):
    page = admin_client.post("/admin/hosts/host/add/", {"name": "box", "address": "10.0.0.7:7701"})
    assert page.status_code == 200
    assert re.search(r"capyjoin_[A-Za-z0-9_=-]+", page.content.decode())
    assert Host.objects.get(name="box").join_secret_hmac
    bad = admin_client.post("/admin/hosts/host/add/", {"name": "box2", "address": "nowhere"})
    assert bad.status_code == 200
    assert "address" in bad.content.decode()
    assert not Host.objects.filter(name="box2").exists()


def test_admin_actions_hand_the_work_to_the_scheduler(admin_client):
    add_engine("sim", kind="vllm", command="python -m hostagent.sim vllm")
    llama = add_deployment(DeploymentSpec(name="llama", engine="sim", source="/m/llama"))
    url = "/admin/deployments/deployment/"

    def act(action):
        return admin_client.post(
            url, {"action": action, "_selected_action": [llama.pk]}, follow=True
        ).content.decode()

    # No server runs: a stop is saved as the wish; a park cannot happen and says why.
    assert "No CapyCTL server is running" in act("stop")
    assert Deployment.objects.get(pk=llama.pk).desired_state == "stopped"
    assert "Cannot park llama: no CapyCTL server is running" in act("park_ram")
    assert not Operation.objects.exists()
    # A server beats: the action becomes an operation for it to carry out.
    Host.objects.filter(name="local").update(heartbeat_at=timezone.now())
    if not Host.objects.filter(name="local").exists():
        Host.objects.create(name="local", is_local=True, heartbeat_at=timezone.now())
    assert "Asked to start llama" in act("start")
    op = Operation.objects.get()
    assert (op.action, op.actor, op.status) == ("start", "alice", "pending")
    assert Deployment.objects.get(pk=llama.pk).desired_state == "running"
    act("park_deep")
    assert Operation.objects.filter(action="park", mode="deep").exists()


def test_an_engine_saved_in_the_admin_goes_through_the_service(admin_client):
    from capyctl.engines.models import Engine
    from capyctl.events.models import Event

    form = {"name": "sim", "kind": "vllm", "command": "python -m hostagent.sim vllm",
            "env": '{"A": "1"}', "options": "{}"}  # fmt: skip
    assert admin_client.post("/admin/engines/engine/add/", form).status_code == 302
    engine = Engine.objects.get(name="sim")
    assert engine.env == {"A": "1"}
    assert Event.objects.filter(kind="engine.added", actor="alice").exists()
    changed = admin_client.post(
        f"/admin/engines/engine/{engine.pk}/change/",
        {**form, "command": "python -m hostagent.sim sglang"},
    )
    assert changed.status_code == 302
    assert Engine.objects.get(pk=engine.pk).command.endswith("sglang")
    assert Event.objects.filter(kind="engine.changed", actor="alice").exists()
    bad = admin_client.post("/admin/engines/engine/add/", {**form, "name": "x", "kind": "nope"})
    assert bad.status_code == 200
    assert Engine.objects.count() == 1
