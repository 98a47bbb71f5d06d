"""API keys: shown once, stored as an HMAC, checked in constant time, revocable."""

import json
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from capyctl.access.models import ApiKey
from capyctl.access.services import find_api_key, issue_api_key, revoke_api_key
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.errors import UserError
from capyctl.secret_hashing import hash_secret


@pytest.fixture
def models(db):
    add_engine("v1", kind="vllm", command="/opt/vllm/bin/vllm")
    add_deployment(DeploymentSpec(name="a", engine="v1", source="/models/a"))
    add_deployment(DeploymentSpec(name="b", engine="v1", source="/models/b"))


def test_only_an_hmac_of_the_secret_is_stored(bob):
    key, full_key = issue_api_key("bob", name="laptop")
    prefix, key_id, secret = full_key.split("_", 2)
    assert prefix == "capy"
    assert key_id == key.key_id
    stored = ApiKey.objects.get(pk=key.pk)
    assert stored.secret_hmac == hash_secret(secret)
    assert secret not in stored.secret_hmac
    for value in stored.__dict__.values():
        assert secret not in str(value)


def test_a_key_is_found_only_with_its_exact_secret(bob):
    key, full_key = issue_api_key("bob")
    assert find_api_key(full_key) == key
    assert find_api_key(full_key[:-1] + ("A" if full_key[-1] != "A" else "B")) is None
    assert find_api_key(f"capy_{key.key_id}_") is None
    assert find_api_key("sk-not-ours") is None
    assert find_api_key("") is None


def test_revoked_and_expired_keys_no_longer_work(bob):
    key, full_key = issue_api_key("bob")
    revoke_api_key(key.prefix)
    assert find_api_key(full_key) is None
    first = ApiKey.objects.get(pk=key.pk).revoked_at
    revoke_api_key(key.key_id)  # twice is harmless
    assert ApiKey.objects.get(pk=key.pk).revoked_at == first

    expiring, expiring_key = issue_api_key("bob", expires_in=timedelta(days=1))
    assert find_api_key(expiring_key) == expiring
    ApiKey.objects.filter(pk=expiring.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert find_api_key(expiring_key) is None


def test_a_deactivated_user_loses_their_keys(bob):
    _, full_key = issue_api_key("bob")
    bob.is_active = False
    bob.save()
    assert find_api_key(full_key) is None


def test_the_admin_scope_needs_a_staff_user(alice, bob):
    key, _ = issue_api_key("alice", admin=True)
    assert key.is_admin
    with pytest.raises(UserError, match="not staff"):
        issue_api_key("bob", admin=True)


def test_keys_limited_to_models(bob, models, cli):
    result = cli(
        "key", "create", "--user", "bob", "--models", "a", "--expires", "30d", "--rpm", "60"
    )
    assert result.code == 0, result.err
    assert "models a" in result.err
    assert "shown only now" in result.err
    (row,) = json.loads(cli("key", "list", "--user", "bob", "--json").out)
    assert row["models"] == ["a"]
    assert row["requests_per_minute"] == 60
    expires = datetime.fromisoformat(row["expires_at"])
    assert timedelta(days=29, hours=23) < expires - timezone.now() <= timedelta(days=30)


def test_cli_revoke_and_list(bob, cli):
    created = cli("key", "create", "--user", "bob", "--name", "ci")
    full_key = created.out.strip()
    key_id = full_key.split("_")[1]
    listed = cli("key", "list")
    assert key_id in listed.out
    assert "active" in listed.out
    assert full_key not in listed.out
    assert cli("key", "revoke", key_id).code == 0
    assert "revoked" in cli("key", "list").out
    assert find_api_key(full_key) is None


def test_users_are_added_with_a_password_shown_once(cli):
    result = cli("user", "add", "carol")
    assert result.code == 0, result.err
    password = result.out.split("password: ")[1].split()[0]
    from django.contrib.auth import authenticate

    assert authenticate(username="carol", password=password) is not None
    staff = json.loads(cli("user", "list", "--json").out)
    no_ceilings = {"models": None, "requests_per_minute": None, "max_concurrent": None,
                   "key_lifetime_seconds": None}  # fmt: skip
    assert {"name": "carol", "staff": False, "active": True, "keys": 0,
            "limits": no_ceilings} in staff  # fmt: skip


def test_rests_answer_with_a_new_key_is_never_stored(alice, bob):
    """No cache (a client's, a proxy's) may keep the 201 that holds a new key, whether a
    session or an admin key asked for it."""
    from rest_framework.test import APIClient

    session = APIClient()
    session.force_login(bob)
    made = session.post("/api/keys/", {"name": "laptop"}, format="json")
    assert made.status_code == 201, made.content
    assert made.json()["key"].startswith("capy_")
    assert "no-store" in made["Cache-Control"]
    _, admin_key = issue_api_key("alice", admin=True)
    automation = APIClient()
    automation.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    for_bob = automation.post("/api/keys/", {"user": "bob"}, format="json")
    assert for_bob.status_code == 201, for_bob.content
    assert "no-store" in for_bob["Cache-Control"]
