"""Liveness, readiness, the admin and static assets, through the ASGI application."""

import json

import httpx
import pytest
from django.test import override_settings

from capyctl.asgi import application
from capyctl.deployments.models import Deployment
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
