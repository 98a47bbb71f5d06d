"""The REST API under /api/: every resource's create/read/update/delete, who may do what
(staff session, user session, anonymous; admin key, user key), errors per field, and the
OpenAPI schema."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from capyctl.access.models import ApiKey
from capyctl.access.services import issue_api_key
from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.scheduler.host_states import ensure_local_host
from hostagent.probe import Inventory
from tests.conftest import table_counts

pytestmark = pytest.mark.django_db

SIM = "python -m hostagent.sim vllm"


def as_key(full_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {full_key}")
    return client


def as_session(user: User, *, csrf: bool = False) -> APIClient:
    client = APIClient(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


@pytest.fixture
def admin_key(alice) -> str:
    return issue_api_key("alice", admin=True)[1]


@pytest.fixture
def staff(alice) -> APIClient:
    return as_session(alice)


@pytest.fixture
def engine(staff) -> dict[str, object]:
    answer = staff.post("/api/engines/", {"name": "sim", "kind": "vllm", "command": SIM},
                        format="json")  # fmt: skip
    assert answer.status_code == 201, answer.content
    return dict(answer.json())


@pytest.fixture
def model(staff, engine) -> dict[str, object]:
    answer = staff.post(
        "/api/deployments/",
        {"name": "llama", "engine": "sim", "source": "/m/llama", "gpu_memory": "16GiB",
         "aliases": ["chat"]},
        format="json",
    )  # fmt: skip
    assert answer.status_code == 201, answer.content
    return dict(answer.json())


# -- who may do what ------------------------------------------------------------------------

ADMIN_ONLY = [
    "/api/engines/", "/api/deployments/", "/api/hosts/", "/api/users/", "/api/ledger/",
    "/api/events/", "/api/operations/",
]  # fmt: skip


@pytest.mark.parametrize("url", [*ADMIN_ONLY, "/api/keys/"])
def test_anonymous_is_refused_everywhere(db, url):
    answer = APIClient().get(url)
    assert answer.status_code in (401, 403)
    assert "detail" in answer.json()
    assert APIClient().post(url, {}, format="json").status_code in (401, 403)


@pytest.mark.parametrize("url", ADMIN_ONLY)
def test_staff_session_and_admin_key_may_read_everything(alice, admin_key, url):
    for client in (as_session(alice), as_key(admin_key)):
        answer = client.get(url)
        assert answer.status_code == 200, (url, answer.content)
        assert {"count", "results"} <= set(answer.json())


@pytest.mark.parametrize("url", ADMIN_ONLY)
def test_an_ordinary_user_is_refused_the_admin_resources(bob, url):
    answer = as_session(bob).get(url)
    assert answer.status_code == 403
    assert as_session(bob).post(url, {}, format="json").status_code == 403


def test_a_key_without_admin_scope_is_for_v1_only(alice, bob):
    for owner in ("alice", "bob"):  # even a staff user's plain key
        key = issue_api_key(owner)[1]
        for url in [*ADMIN_ONLY, "/api/keys/"]:
            answer = as_key(key).get(url)
            assert answer.status_code == 403, url
            assert "no admin scope" in answer.json()["detail"]


def test_a_wrong_revoked_or_foreign_token_is_refused(alice):
    key, full = issue_api_key("alice", admin=True)
    assert as_key(full + "x").get("/api/engines/").status_code == 401
    assert as_key("sk-not-ours").get("/api/engines/").json()["detail"] == (
        "the bearer token is not a CapyCTL API key"
    )
    ApiKey.objects.filter(pk=key.pk).update(is_admin=True)
    User.objects.filter(username="alice").update(is_staff=False)  # no longer staff
    assert as_key(full).get("/api/engines/").status_code == 403
    User.objects.filter(username="alice").update(is_staff=True)
    assert (
        as_session(User.objects.get(username="alice"))
        .delete(f"/api/keys/{key.key_id}/")
        .status_code
        == 204
    )
    answer = as_key(full).get("/api/engines/")
    assert answer.status_code == 401
    assert answer.json()["detail"] == "invalid, revoked or expired API key"
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_session_needs_its_csrf_token_to_change_anything(alice):
    client = as_session(alice, csrf=True)
    answer = client.post("/api/engines/", {"name": "x", "kind": "vllm", "command": SIM},
                         format="json")  # fmt: skip
    assert answer.status_code == 403
    assert "CSRF" in answer.json()["detail"]
    assert not Engine.objects.exists()
    assert client.get("/api/engines/").status_code == 200  # reading needs none


# -- engines --------------------------------------------------------------------------------


def test_engines_crud(staff, engine):
    assert engine == {**engine, "name": "sim", "kind": "vllm", "command": SIM, "host": None}
    assert staff.get("/api/engines/sim/").json()["name"] == "sim"
    assert staff.get("/api/engines/?kind=vllm").json()["count"] == 1
    assert staff.get("/api/engines/?kind=sglang").json()["count"] == 0
    changed = staff.patch("/api/engines/sim/", {"command": f"{SIM} --quiet"}, format="json")
    assert changed.status_code == 200
    assert changed.json()["command"] == f"{SIM} --quiet"
    renamed = staff.patch("/api/engines/sim/", {"name": "sim2"}, format="json")
    assert renamed.json()["name"] == "sim2"
    assert staff.get("/api/engines/sim/").status_code == 404
    assert staff.delete("/api/engines/sim2/").status_code == 204
    assert not Engine.objects.exists()
    assert "engine.changed" in set(Event.objects.values_list("kind", flat=True))


def test_engine_errors_name_their_field_and_change_nothing(staff, engine):
    before = table_counts()
    bad_kind = staff.post("/api/engines/", {"name": "x", "kind": "nope", "command": SIM},
                          format="json")  # fmt: skip
    assert bad_kind.status_code == 400
    assert list(bad_kind.json()) == ["kind"]
    assert "nope" in bad_kind.json()["kind"][0]
    duplicate = staff.post("/api/engines/", {"name": "sim", "kind": "vllm", "command": SIM},
                           format="json")  # fmt: skip
    assert duplicate.json() == {"name": ["an engine named 'sim' already exists"]}
    missing = staff.post("/api/engines/", {"name": "y"}, format="json")
    assert set(missing.json()) == {"kind", "command"}
    assert staff.get("/api/engines/nope/").json() == {"detail": "no engine named 'nope'"}
    assert staff.patch("/api/engines/sim/", {"kind": "bogus"}, format="json").status_code == 400
    assert table_counts() == before


# -- deployments ----------------------------------------------------------------------------


def test_deployments_crud(staff, model):
    assert model["name"] == "llama"
    assert model["aliases"] == ["chat"]
    assert model["gpu_memory_bytes"] == 16 * 1024**3
    assert (model["desired_state"], model["observed_state"]) == ("running", "stopped")
    assert staff.get("/api/deployments/chat/").json()["name"] == "llama"  # by alias
    assert staff.get("/api/deployments/?observed_state=stopped").json()["count"] == 1
    assert staff.get("/api/deployments/?engine=other").json()["count"] == 0
    changed = staff.patch(
        "/api/deployments/llama/",
        {"gpu_memory": "0.5", "idle_park_seconds": 60, "pinned": True, "engine_args": ["-t", "1"]},
        format="json",
    )
    assert changed.status_code == 200, changed.content
    data = changed.json()
    assert (data["gpu_memory_bytes"], data["gpu_memory_fraction"]) == (None, 0.5)
    assert (data["idle_park_seconds"], data["pinned"], data["engine_args"]) == (
        60,
        True,
        ["-t", "1"],
    )
    assert data["aliases"] == ["chat"]  # untouched by a partial change
    back = staff.patch("/api/deployments/llama/", {"idle_park_seconds": None}, format="json")
    assert back.json()["idle_park_seconds"] == 0  # back to the default (docs/configuration.md)
    assert staff.delete("/api/deployments/llama/").status_code == 204
    assert not Deployment.objects.exists()


def test_deployment_errors_name_their_field_and_change_nothing(staff, model):
    before = table_counts()
    for body, field in [
        ({"name": "x", "engine": "sim", "source": "/m/x", "gpu_memory": "lots"}, "gpu_memory"),
        ({"name": "x", "engine": "sim", "source": "/m/x", "aliases": ["llama"]}, "aliases"),
        ({"name": "bad name", "engine": "sim", "source": "/m/x"}, "name"),
        ({"name": "x", "engine": "sim", "source": "/m/x", "park": "sideways"}, "park"),
        ({"name": "x", "engine": "sim", "source": "/m/x", "gpus": 65}, "gpus"),
    ]:
        answer = staff.post("/api/deployments/", body, format="json")
        assert answer.status_code == 400, (body, answer.content)
        assert field in answer.json(), (body, answer.json())
    # An engine that does not exist is a thing named that is not there: 404, saying which.
    unknown = staff.post("/api/deployments/", {"name": "x", "engine": "nope", "source": "/m/x"},
                         format="json")  # fmt: skip
    assert unknown.status_code == 404, unknown.content
    assert unknown.json() == {"detail": "no engine named 'nope'"}
    Deployment.objects.filter(name="llama").update(observed_state="ready")
    refused = staff.delete("/api/deployments/llama/")
    assert refused.json() == {"name": ["deployment 'llama' is ready; stop it first"]}
    assert table_counts() == before


def test_actions_without_a_server_save_the_wish_or_say_why_not(staff, model):
    stop = staff.post("/api/deployments/llama/stop/", {}, format="json")
    assert stop.status_code == 202
    assert stop.json()["desired_state"] == "stopped"
    park = staff.post("/api/deployments/llama/park/", {"mode": "ram"}, format="json")
    assert park.status_code == 400
    assert "no CapyCTL server is running" in park.json()["non_field_errors"][0]
    wrong = staff.post("/api/deployments/llama/wake/", {"mode": "deep"}, format="json")
    assert wrong.status_code == 400
    assert "mode" in wrong.json()
    assert staff.post("/api/deployments/nope/start/", {}, format="json").status_code == 404


# -- hosts ----------------------------------------------------------------------------------


def test_hosts_crud_with_a_join_token(staff):
    added = staff.post("/api/hosts/", {"name": "box", "address": "10.0.0.7:7701"}, format="json")
    assert added.status_code == 201, added.content
    assert added.json()["join_token"].startswith("capyjoin_")
    assert added.json()["state"] == "unknown"
    assert "no-store" in added["Cache-Control"]  # it holds a secret: no cache may keep it
    listed = staff.get("/api/hosts/?state=unknown").json()
    assert [h["name"] for h in listed["results"]] == ["box"]
    assert "join_token" not in staff.get("/api/hosts/box/").json()
    renewed = staff.post("/api/hosts/box/token/", {}, format="json")
    assert "no-store" in renewed["Cache-Control"]
    token = renewed.json()["join_token"]
    assert token != added.json()["join_token"]
    change = {"address": "10.0.0.8:7701", "gpu_reserve_bytes": 1024**3}
    changed = staff.patch("/api/hosts/box/", change, format="json")
    assert changed.status_code == 200
    assert changed.json()["address"] == "10.0.0.8:7701"
    assert Host.objects.get(name="box").gpu_reserve_bytes == 1024**3
    bad = staff.patch("/api/hosts/box/", {"address": "no-port"}, format="json")
    assert bad.status_code == 400
    assert "address" in bad.json()
    assert staff.delete("/api/hosts/box/").status_code == 204
    assert not Host.objects.filter(name="box").exists()


# -- keys -----------------------------------------------------------------------------------


def test_a_user_manages_only_their_own_keys(alice, bob, model):
    bobs = as_session(bob)
    made = bobs.post("/api/keys/", {"name": "laptop", "models": ["llama"]}, format="json")
    assert made.status_code == 201, made.content
    full = made.json()["key"]
    assert full.startswith("capy_")
    key_id = made.json()["id"]
    assert made.json()["models"] == ["llama"]
    assert "key" not in bobs.get(f"/api/keys/{key_id}/").json()  # shown once
    alices_key = issue_api_key("alice", name="ops")[0]
    assert [k["name"] for k in bobs.get("/api/keys/").json()["results"]] == ["laptop"]
    assert bobs.get(f"/api/keys/{alices_key.key_id}/").status_code == 404
    assert bobs.delete(f"/api/keys/{alices_key.key_id}/").status_code == 404
    assert bobs.post("/api/keys/", {"user": "alice"}, format="json").status_code == 403
    admin = bobs.post("/api/keys/", {"admin": True}, format="json")
    assert admin.json() == {
        "admin": ["user 'bob' is not staff, so their keys cannot have the admin scope"]
    }
    changed = bobs.patch(f"/api/keys/{key_id}/", {"requests_per_minute": 30, "models": []},
                         format="json")  # fmt: skip
    assert (changed.json()["requests_per_minute"], changed.json()["models"]) == (30, [])
    assert bobs.delete(f"/api/keys/{key_id}/").status_code == 204
    assert bobs.get(f"/api/keys/{key_id}/").json()["revoked"] is True
    # Staff see every key and issue them for anyone.
    staff_keys = as_session(alice).get("/api/keys/").json()
    assert {k["user"] for k in staff_keys["results"]} == {"alice", "bob"}
    for_bob = as_session(alice).post("/api/keys/", {"user": "bob", "expires": "30d"}, format="json")
    assert for_bob.status_code == 201
    assert for_bob.json()["user"] == "bob"
    assert for_bob.json()["expires_at"]
    assert (
        as_session(alice).post("/api/keys/", {"expires": "soon"}, format="json").status_code == 400
    )


# -- users ----------------------------------------------------------------------------------


def test_users_crud(staff, alice):
    made = staff.post(
        "/api/users/", {"username": "carol", "password": "carol-pass-1"}, format="json"
    )
    assert made.status_code == 201
    assert made.json() == {**made.json(), "username": "carol", "staff": False, "active": True}
    assert "password" not in made.json()
    assert staff.post("/api/users/", {"username": "carol"}, format="json").status_code == 400
    short = staff.post("/api/users/", {"username": "dave", "password": "short"}, format="json")
    assert short.json() == {"password": ["a password is at least 8 characters"]}
    changed = staff.patch("/api/users/carol/", {"staff": True, "active": False}, format="json")
    assert (changed.json()["staff"], changed.json()["active"]) == (True, False)
    assert staff.get("/api/users/?is_active=false").json()["count"] == 1
    myself = staff.patch("/api/users/alice/", {"active": False}, format="json")
    assert myself.json() == {
        "active": ["you cannot take away your own staff rights or deactivate yourself"]
    }
    assert staff.delete("/api/users/alice/").json() == {
        "username": ["you cannot remove your own user"]
    }
    assert staff.delete("/api/users/carol/").status_code == 204
    assert staff.get("/api/users/carol/").status_code == 404


# -- read-only records ----------------------------------------------------------------------


def test_ledger_events_and_operations_are_read_only_with_filters(staff, model):
    from capyctl.ledger.models import LedgerEntry
    from capyctl.scheduler.models import Operation

    host = Host.objects.create(name="box", address="10.0.0.7:7701")
    deployment = Deployment.objects.get(name="llama")
    LedgerEntry.objects.create(
        host=host, pool="gpu0", deployment=deployment, bytes=5, status="held"
    )
    LedgerEntry.objects.create(
        host=host, pool="ram", deployment=deployment, bytes=7, status="promised"
    )
    held = staff.get("/api/ledger/?status=held").json()
    assert [(e["pool"], e["bytes"], e["deployment"]) for e in held["results"]] == [
        ("gpu0", 5, "llama")
    ]
    assert staff.get("/api/ledger/?deployment=llama&host=box").json()["count"] == 2
    events = staff.get("/api/events/?kind=deployment&limit=1").json()
    assert events["count"] >= 1
    assert len(events["results"]) == 1
    assert events["results"][0]["subject"] == "llama"
    assert staff.get("/api/events/?since=2999-01-01T00:00:00Z").json()["count"] == 0
    op = Operation.objects.create(deployment=deployment, action="park", mode="ram")
    assert staff.get(f"/api/operations/{op.pk}/").json()["status"] == "pending"
    for url in ("/api/ledger/", "/api/events/", "/api/operations/"):
        assert staff.post(url, {}, format="json").status_code == 405
    entry = LedgerEntry.objects.get(pool="gpu0")
    assert staff.delete(f"/api/ledger/{entry.pk}/").status_code == 405


def test_lists_are_paginated(staff, engine):
    for i in range(5):
        staff.post("/api/deployments/", {"name": f"m{i}", "engine": "sim", "source": f"/m/{i}"},
                   format="json")  # fmt: skip
    page = staff.get("/api/deployments/?limit=2&offset=2").json()
    assert page["count"] == 5
    assert [d["name"] for d in page["results"]] == ["m2", "m3"]
    assert "offset=4" in page["next"]


def test_the_openapi_schema_and_its_docs_page(staff):
    schema = staff.get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in ("/api/engines/", "/api/deployments/{name}/park/", "/api/keys/{key_id}/",
                 "/api/hosts/{name}/token/", "/api/ledger/", "/api/events/"):  # fmt: skip
        assert path in paths, path
    assert "apiKey" in schema.json()["components"]["securitySchemes"]
    docs = staff.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content


def test_out_of_range_figures_are_refused_not_overflowed(staff, engine):
    """Found by schemathesis: numbers past what the database holds got a 500."""
    ensure_local_host(Inventory(probe="none", ram_total_bytes=64 * 1024**3))
    before = table_counts()
    bodies: list[tuple[dict[str, object], str]] = [
        ({"gpu_memory": "99999999999999999999999GiB"}, "gpu_memory"),
        ({"idle_park_seconds": 10**30}, "idle_park_seconds"),
    ]
    for body, field in bodies:
        answer = staff.post(
            "/api/deployments/",
            {"name": "x", "engine": "sim", "source": "/m", **body},
            format="json",
        )
        assert answer.status_code == 400
        assert field in answer.json()
    huge = staff.patch("/api/hosts/local/", {"ram_reserve_bytes": 10**21}, format="json")
    assert huge.status_code == 400, huge.content
    assert "ram_reserve_bytes" in huge.json()
    assert Host.objects.get(name="local").ram_reserve_bytes is None  # unchanged
    # A host that does not exist: 404, saying which.
    ghost = staff.patch("/api/hosts/ghost/", {"ram_reserve_bytes": 1024**3}, format="json")
    assert ghost.status_code == 404, ghost.content
    assert ghost.json() == {"detail": "no host named 'ghost'"}
    assert staff.post("/api/keys/", {"expires": "999999999999d"}, format="json").json() == {
        "expires": ["invalid expires '999999999999d': at most 100 years"]
    }
    assert table_counts() == before
    assert staff.get(f"/api/keys/?limit={10**36}&offset=-4").status_code == 200
    assert staff.get(f"/api/events/?offset={10**36}").json()["results"] == []
    # Found by schemathesis on PostgreSQL: an offset Python accepts and the database not.
    odd = staff.get("/api/events/?since=0602-11-06T05%3A26%3A19%2B19%3A04")
    assert odd.status_code == 200
    assert odd.json()["count"] >= 1
    early = staff.get("/api/events/?since=0001-01-01T00%3A00%3A00%2B05%3A00")
    assert early.status_code == 400
    assert early.json() == {"since": ["the time is out of range"]}
