"""/keys/: a logged-in user creates, lists and revokes their own API keys."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from capyctl.access.models import ApiKey
from capyctl.access.services import find_api_key, issue_api_key
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine

pytestmark = pytest.mark.django_db


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_anonymous_is_sent_to_log_in(db):
    answer = Client().get("/keys/")
    assert answer.status_code == 302
    assert answer["Location"] == "/login/?next=/keys/"


def test_any_user_logs_in_and_creates_a_key_shown_once(bob):
    add_engine("sim", kind="vllm", command="python -m hostagent.sim vllm")
    add_deployment(DeploymentSpec(name="llama", engine="sim", source="/m/llama", replicas=2))
    client = Client()
    login = client.post(
        "/login/", {"username": "bob", "password": "bob-password-1", "next": "/keys/"}
    )
    assert (login.status_code, login["Location"]) == (302, "/keys/")
    page = client.get("/keys/")
    assert b"No keys yet." in page.content
    assert b'<option value="llama">' in page.content
    assert b"llama~1" not in page.content  # a key names models, not their replicas
    made = client.post("/keys/", {"name": "laptop", "models": ["llama"], "expires": "30d"})
    assert made.status_code == 200
    (full,) = re.findall(rb"capy_[a-z0-9]+_[A-Za-z0-9_-]+", made.content)
    key = find_api_key(full.decode())
    assert key is not None
    assert (key.user.username, key.name) == ("bob", "laptop")
    assert [d.name for d in key.allowed_models.all()] == ["llama"]
    assert key.expires_at is not None
    again = client.get("/keys/")
    assert full not in again.content  # shown once
    assert key.prefix.encode() in again.content
    assert b"laptop" in again.content


def test_errors_are_one_line_and_change_nothing(bob):
    client = logged_in(bob)
    for form, message in [
        ({"name": "x" * 101}, b"a key name is at most 100 characters"),
        ({"name": "x", "models": ["nope"]}, b"no deployment named"),
        ({"name": "x", "expires": "forever"}, b"unknown expiry"),
    ]:
        answer = client.post("/keys/", form)
        assert answer.status_code == 400
        assert message in answer.content
    assert not ApiKey.objects.exists()


def test_a_user_revokes_their_own_key_only(alice, bob):
    # Names no random token on the page (a key id, the form's CSRF token) holds by chance:
    # the page once held "ops" somewhere in one.
    mine, full = issue_api_key("bob", name="bobs-old-key")
    theirs, _ = issue_api_key("alice", name="alices-ops-key")
    client = logged_in(bob)
    page = client.get("/keys/").content
    assert b"bobs-old-key" in page
    assert b"alices-ops-key" not in page  # alice's key is not listed
    assert theirs.key_id.encode() not in page
    refused = client.post(f"/keys/{theirs.key_id}/revoke/")
    assert refused.status_code == 400
    assert b"you have no API key with id" in refused.content
    theirs.refresh_from_db()
    assert theirs.revoked_at is None
    done = client.post(f"/keys/{mine.key_id}/revoke/")
    assert (done.status_code, done["Location"]) == (302, "/keys/")
    assert find_api_key(full) is None
    assert client.get(f"/keys/{mine.key_id}/revoke/").status_code == 405


def test_the_form_needs_its_csrf_token(bob):
    client = Client(enforce_csrf_checks=True)
    client.force_login(bob)
    assert client.post("/keys/", {"name": "x"}).status_code == 403
    assert not ApiKey.objects.exists()


def test_the_page_that_shows_a_new_key_is_never_stored(bob):
    """No cache (the browser's, a proxy's) may keep the answer that holds a new key."""
    client = logged_in(bob)
    made = client.post("/keys/", {"name": "laptop", "expires": ""})
    assert made.status_code == 200
    assert re.search(rb"capy_[a-z0-9]+_[A-Za-z0-9_-]+", made.content)
    assert "no-store" in made["Cache-Control"]
    assert "no-store" in client.get("/keys/")["Cache-Control"]  # the list too
