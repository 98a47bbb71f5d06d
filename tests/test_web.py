"""Liveness, readiness, the admin and static assets, through the ASGI application."""

import json
import re

import httpx
import pytest
from django.test import Client, override_settings

from capyctl.asgi import application, static_application
from capyctl.deployments.models import Deployment
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.events.models import Event


@pytest.fixture
def asgi_client():
    transport = httpx.ASGITransport(app=application)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


@pytest.mark.django_db(transaction=True)
async def test_healthz_and_readyz(asgi_client):
    async with asgi_client as client:
        health = await client.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok"}
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"] == {"database": "ok", "broker": "not configured"}


@pytest.mark.django_db
def test_readyz_checks_the_broker_when_one_is_configured(client):
    with override_settings(REDIS_URL="redis://127.0.0.1:6379/15"):
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"]["broker"] == "ok"
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        down = client.get("/readyz")
        assert down.status_code == 503
        assert down.json()["status"] == "unavailable"
        assert down.json()["checks"]["broker"] == "failing"


async def test_static_assets_are_served_without_django(asgi_client):
    async with asgi_client as client:
        css = await client.get("/static/admin/css/base.css")
        assert css.status_code == 200
        assert css.headers["content-type"] == "text/css"
        again = await client.get(
            "/static/admin/css/base.css", headers={"if-none-match": css.headers["etag"]}
        )
        assert again.status_code == 304
        assert (await client.get("/static/admin/css/missing.css")).status_code == 404
        assert (await client.get("/static/../capyctl/settings.py")).status_code == 404
        assert (await client.get("/static/%2e%2e/capyctl/settings.py")).status_code == 404
        assert (await client.post("/static/admin/css/base.css")).status_code == 405


@pytest.mark.django_db
def test_admin_login_page_and_pages_for_staff(client, alice):
    assert client.get("/admin/login/").status_code == 200
    assert client.get("/admin/").status_code == 302
    client.force_login(alice)
    alice.is_superuser = True
    alice.save()
    for path in (
        "/admin/",
        "/admin/deployments/deployment/",
        "/admin/deployments/deployment/add/",
        "/admin/engines/engine/add/",
        "/admin/ledger/ledgerentry/",
        "/admin/events/event/",
        "/admin/access/apikey/",
        "/admin/hosts/host/",
    ):
        assert client.get(path).status_code == 200, path


@pytest.mark.django_db
def test_the_admin_validates_through_the_service_layer(client, alice):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    engine = add_engine("v1", kind="vllm", command="/opt/vllm/bin/vllm")
    form = {
        "name": "chat",
        "aliases_text": "qwen, chat-latest",
        "engine": engine.pk,
        "source": "/models/qwen",
        "gpu_memory": "20GiB",
        "gpus": 1,
        "park": "auto",
        "priority": 0,
    }
    created = client.post("/admin/deployments/deployment/add/", form)
    assert created.status_code == 302, created.content.decode()[:2000]
    chat = Deployment.objects.get(name="chat")
    assert sorted(chat.alias_names) == ["chat-latest", "qwen"]
    assert chat.gpu_memory_bytes == 20 * 1024**3
    assert Event.objects.filter(kind="deployment.added", actor="alice").exists()

    clash = client.post(
        "/admin/deployments/deployment/add/", {**form, "name": "other", "aliases_text": "chat"}
    )
    assert clash.status_code == 200
    assert "already the name of another deployment" in clash.content.decode()
    bad_fraction = client.post(
        "/admin/deployments/deployment/add/",
        {**form, "name": "other", "aliases_text": "", "gpu_memory": "1.5"},
    )
    assert "a fraction must lie in (0, 1]" in bad_fraction.content.decode()
    assert Deployment.objects.count() == 1

    changed = client.post(
        f"/admin/deployments/deployment/{chat.pk}/change/",
        {**form, "aliases_text": "qwen", "gpu_memory": "0.5"},
    )
    assert changed.status_code == 302
    chat = Deployment.objects.get(pk=chat.pk)
    assert chat.alias_names == ["qwen"]
    assert chat.gpu_memory_fraction == 0.5
    assert chat.gpu_memory_bytes is None

    bad_engine = client.post(
        "/admin/engines/engine/add/",
        {
            "name": "c1",
            "kind": "custom",
            "command": "server --model {model}",
            "env": "{}",
            "options": "{}",
        },
    )
    assert "must contain {port}" in bad_engine.content.decode()


def test_a_database_that_does_not_answer_is_a_503_page_not_a_bare_500(rf):
    """Any page failing because the database (or Redis) did not answer: Django's bare 500
    before; 503 with Retry-After now, JSON under /api/. Any other failure stays a 500."""
    from django.db import OperationalError

    from capyctl.web.views import server_error

    def answer(path, failure):
        try:
            raise failure
        except Exception:  # Django calls the handler while the failure is being handled
            return server_error(rf.get(path))

    page = answer("/admin/", OperationalError("connection refused"))
    assert (page.status_code, page["Retry-After"]) == (503, "1")
    assert b"did not answer; retry shortly" in page.content
    api = answer("/api/deployments/", OperationalError("connection refused"))
    assert api.status_code == 503
    assert json.loads(api.content)["code"] == "control_plane_unavailable"
    assert answer("/admin/", ValueError("a bug")).status_code == 500


async def test_the_favicon_is_served_without_django(asgi_client):
    """Every page's browser asked /favicon.ico and got 404."""
    assert static_application.handles({"type": "http", "path": "/favicon.ico"})  # not Django
    async with asgi_client as client:
        icon = await client.get("/favicon.ico")
        assert icon.status_code == 200
        assert icon.headers["content-type"] == "image/vnd.microsoft.icon"
        assert icon.content[:4] == b"\0\0\1\0"  # an ICO file
        assert icon.headers["cache-control"] == "public, max-age=3600"
        svg = await client.get("/static/capyctl/favicon.svg")
        assert svg.status_code == 200
        assert svg.headers["content-type"] == "image/svg+xml"
        assert (await client.get("/favicon.png")).status_code == 404


@pytest.mark.django_db
def test_pages_link_the_favicon(client, alice):
    link = b'<link rel="icon" href="/static/capyctl/favicon.svg" type="image/svg+xml">'
    assert link in client.get("/login/").content
    assert link in client.get("/admin/login/").content
    client.force_login(alice)
    for path in ("/", "/keys/", "/admin/"):
        assert link in client.get(path).content, path


@pytest.mark.django_db
def test_the_api_link_sends_a_logged_out_browser_to_log_in_and_back(client, alice, bob):
    """The start banner's ``api:`` link is /api/docs/: a logged-out browser got a bare 401
    there. It now gets the login page, which sends it back; other clients get 401 as before."""
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    sent = client.get("/api/docs/", headers=browser)
    assert (sent.status_code, sent["Location"]) == (302, "/login/?next=/api/docs/")
    asked = client.get("/api/docs/?tag=keys", headers=browser)
    assert asked["Location"] == "/login/?next=/api/docs/%3Ftag%3Dkeys"
    refused = client.get("/api/docs/", headers={"Accept": "*/*"})  # curl, httpx: as before
    assert refused.status_code == 401
    assert refused["WWW-Authenticate"].startswith("Bearer")
    keyed = client.get("/api/docs/", headers={**browser, "Authorization": "Bearer capy_x_y"})
    assert keyed.status_code == 401  # a key that is wrong is told so, not sent to log in
    back = client.post(
        "/login/",
        {"username": "alice", "password": "alice-password-1", "next": "/api/docs/"},
    )
    assert (back.status_code, back["Location"]) == (302, "/api/docs/")
    assert client.get("/api/docs/", headers=browser).status_code == 200
    away = Client().post(
        "/login/",
        {"username": "alice", "password": "alice-password-1", "next": "https://evil.example/"},
    )
    assert (away.status_code, away["Location"]) == (302, "/")  # not off the site
    bob_client = Client()
    bob_client.force_login(bob)
    assert bob_client.get("/api/docs/", headers=browser).status_code == 403  # not staff


@pytest.mark.django_db
def test_the_admins_pinned_column_shows_no_red_cross(client, alice):
    """The deployments list showed the admin's red ✖ for every model not pinned: it read
    as an error. Pinned or not is now a word or a dash."""
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    add_engine("sim", kind="vllm", command="python -m hostagent.sim vllm")
    add_deployment(DeploymentSpec(name="chat", engine="sim", source="/m/chat", pinned=True))
    add_deployment(DeploymentSpec(name="code", engine="sim", source="/m/code"))
    page = client.get("/admin/deployments/deployment/").content.decode()
    assert "icon-no.svg" not in page
    assert "icon-yes.svg" not in page
    cells = re.findall(r'<td class="field-pinned_mark">([^<]*)</td>', page)
    assert sorted(cells) == ["yes", "—"]
