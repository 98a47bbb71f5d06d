"""Limits bind the key's owner, not only the key: staff set a user's ceilings (models,
requests per minute, requests at once, key lifetime), and no way of making or changing a
key (REST with the user's own session, the keys page, the CLI) gets past them.

Bob attacks a running standalone server as he would from his browser and his shell."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from django.utils import timezone

from capyctl.access.models import ApiKey
from capyctl.access.services import issue_api_key, set_user_limits, update_api_key
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.errors import UserError
from tests.conftest import CliResult, Server, run_program, start_server, stop_server

SIM = f"{sys.executable} -m hostagent.sim"
BOB_PASSWORD = "bob-password-1"
ALICE_PASSWORD = "alice-password-1"

Run = Callable[..., CliResult]


def wait_for(check: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture
def site(program_env) -> Iterator[tuple[Server, Run]]:
    """A standalone server with models a and b (simulated vLLM), staff alice and bob."""
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"
    program_env["CAPYCTL_MIN_READY_SECONDS"] = "0"
    run: Run = lambda *argv, stdin=None: run_program(program_env, *argv, stdin=stdin)  # noqa: E731
    slow = ["--env", "CAPYCTL_SIM_TOKENS_PER_SECOND=10", "--env",
            "CAPYCTL_SIM_COMPLETION_TOKENS=40"]  # fmt: skip
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    assert run("engine", "add", "slow", "--kind", "vllm", "--command", f"{SIM} vllm",
               *slow).code == 0  # fmt: skip
    for name, engine in (("a", "sim"), ("b", "sim"), ("trickle", "slow")):
        added = run("deployment", "add", name, "--engine", engine, "--source", f"m-{name}",
                    "--gpu-memory", "4GiB")  # fmt: skip
        assert added.code == 0, added.err
    staff = run("user", "add", "alice", "--staff", "--password-stdin", stdin=ALICE_PASSWORD)
    assert staff.code == 0, staff.err
    server = start_server(program_env)
    try:
        yield server, run
    finally:
        stop_server(server, signal.SIGTERM)


def log_in(server: Server, username: str, password: str) -> httpx.Client:
    """A browser session: the login form with its CSRF token, then the token on every
    change, as the REST API and the keys page ask."""
    browser = httpx.Client(base_url=server.base_url, timeout=30)
    browser.get("/login/")
    done = browser.post("/login/", data={"username": username, "password": password,
                        "csrfmiddlewaretoken": browser.cookies["csrftoken"]})  # fmt: skip
    assert done.status_code == 302, done.text
    browser.headers["x-csrftoken"] = browser.cookies["csrftoken"]
    return browser


def chat(server: Server, key: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra},
        timeout=60,
    )


def listed(server: Server, key: str) -> set[str]:
    answer = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": key}, timeout=30)
    assert answer.status_code == 200, answer.text
    return {m["id"] for m in answer.json()["data"]}


def test_bob_cannot_widen_his_keys_by_rest_page_or_cli(site):
    server, run = site
    bob = run("user", "add", "bob", "--password-stdin", "--models", "a", "--rpm", "30",
              "--max-concurrent", "2", "--key-lifetime", "30d", stdin=BOB_PASSWORD)  # fmt: skip
    assert bob.code == 0, bob.err
    browser = log_in(server, "bob", BOB_PASSWORD)

    # REST, with his own session and its CSRF token.
    for body, field, words in [
        ({"models": ["b"]}, "models", "bob may use only these models: a; not b"),
        ({"models": ["a", "b"]}, "models", "not b"),
        ({"requests_per_minute": 1000}, "requests_per_minute", "at most 30 requests per minute"),
        ({"max_concurrent": 5}, "max_concurrent", "at most 2 concurrent requests"),
        ({"expires": "365d"}, "expires", "bob's keys may live at most 30d"),
    ]:
        refused = browser.post("/api/keys/", json=body)
        assert refused.status_code == 400, (body, refused.text)
        (message,) = refused.json()[field]
        assert words in message
    assert browser.get("/api/keys/").json()["results"] == []

    made = browser.post("/api/keys/", json={"name": "app", "requests_per_minute": 10})
    assert made.status_code == 201, made.text
    key = made.json()
    assert (key["models"], key["requests_per_minute"], key["max_concurrent"]) == (["a"], 10, 2)
    lives = datetime.fromisoformat(key["expires_at"]) - timezone.now()
    assert timedelta(days=29) < lives <= timedelta(days=30)
    before = browser.get(f"/api/keys/{key['id']}/").json()
    for body in ({"models": ["a", "b"]}, {"models": ["b"]}, {"requests_per_minute": 31},
                 {"max_concurrent": 3}):  # fmt: skip
        assert browser.patch(f"/api/keys/{key['id']}/", json=body).status_code == 400, body
    # "All models" and "no rate limit" mean as much as his ceilings allow, no more.
    widened = browser.patch(f"/api/keys/{key['id']}/",
                            json={"models": [], "requests_per_minute": None})  # fmt: skip
    assert widened.status_code == 200, widened.text
    assert (widened.json()["models"], widened.json()["requests_per_minute"]) == (["a"], 30)
    assert {k: v for k, v in widened.json().items() if k != "requests_per_minute"} == {
        k: v for k, v in before.items() if k != "requests_per_minute"
    }
    assert browser.patch("/api/users/bob/", json={"models": None}).status_code == 403
    assert browser.patch("/api/users/bob/", json={"requests_per_minute": 1000}).status_code == 403

    # The keys page offers only what he may have, and refuses a forged form.
    page = browser.get("/keys/").text
    assert '<option value="a">' in page
    assert '<option value="b">' not in page
    assert 'value="365d"' not in page
    assert "Your keys are limited by staff" in page
    token = {"csrfmiddlewaretoken": browser.cookies["csrftoken"]}
    forms: list[tuple[dict[str, Any], str]] = [
        ({"name": "x", "models": ["b"]}, "bob may use only these models: a; not b"),
        ({"name": "x", "requests_per_minute": "1000"}, "at most 30 requests per minute"),
        ({"name": "x", "max_concurrent": "9"}, "at most 2 concurrent requests"),
        ({"name": "x", "expires": "365d"}, "bob&#x27;s keys may live at most 30d"),
    ]
    for form, words in forms:
        refused = browser.post("/keys/", data={**form, **token})
        assert refused.status_code == 400
        assert words in refused.text, refused.text

    # The CLI (staff at the shell) is held to bob's ceilings too.
    for argv, words in [
        (["--models", "b"], "bob may use only these models: a; not b"),
        (["--rpm", "1000"], "at most 30 requests per minute"),
        (["--max-concurrent", "3"], "at most 2 concurrent requests"),
        (["--expires", "365d"], "bob's keys may live at most 30d"),
    ]:
        refused = run("key", "create", "--user", "bob", *argv)
        assert refused.code != 0
        assert words in refused.err
        assert "Traceback" not in refused.err
    for argv in (["--models", "a,b"], ["--rpm", "31"], ["--max-concurrent", "3"]):
        refused = run("key", "update", key["id"], *argv)
        assert refused.code != 0, argv
        assert "Traceback" not in refused.err
    keys = json.loads(run("key", "list", "--user", "bob", "--json").out)
    assert [k["id"] for k in keys] == [key["id"]]  # nothing was made
    assert keys[0]["models"] == ["a"]

    # A key made within his ceilings works, for his models only.
    full = made.json()["key"]
    assert chat(server, full, "a").status_code == 200
    refused = chat(server, full, "b")
    assert (refused.status_code, refused.json()["error"]["code"]) == (404, "model_not_found")


def test_narrowing_a_user_narrows_the_keys_they_already_have(site):
    server, run = site
    assert run("user", "add", "bob", "--password-stdin", stdin=BOB_PASSWORD).code == 0
    old = run("key", "create", "--user", "bob", "--name", "everything")
    assert old.code == 0, old.err
    old_key = old.out.strip()
    assert {"a", "b"} <= listed(server, old_key)

    alice = log_in(server, "alice", ALICE_PASSWORD)
    narrowed = alice.patch("/api/users/bob/", json={"models": ["a"], "max_concurrent": 4})
    assert narrowed.status_code == 200, narrowed.text
    assert narrowed.json()["limits"]["models"] == ["a"]
    # Within the cache's refresh (a second) on every process.
    wait_for(lambda: listed(server, old_key) == {"a"}, seconds=10)
    refused = chat(server, old_key, "b")
    assert (refused.status_code, refused.json()["error"]["code"]) == (404, "model_not_found")
    stored = json.loads(run("key", "list", "--user", "bob", "--json").out)
    assert stored[0]["models"] == []  # the row is as it was; the ceiling binds it anyway

    users = json.loads(run("user", "list", "--json").out)
    assert next(u for u in users if u["name"] == "bob")["limits"] == {
        "models": ["a"], "requests_per_minute": None, "max_concurrent": 4,
        "key_lifetime_seconds": None,
    }  # fmt: skip
    # A lifetime set later binds old keys too: made before it ran out, so still alive.
    assert run("user", "update", "bob", "--key-lifetime", "1d").code == 0
    assert listed(server, old_key) == {"a"}
    assert run("user", "update", "bob", "--models", "all").code == 0
    wait_for(lambda: {"a", "b"} <= listed(server, old_key), seconds=10)


def test_a_users_keys_share_the_users_rate_and_concurrency(site):
    server, run = site
    added = run("user", "add", "carol", "--password-stdin", "--rpm", "3",
                "--max-concurrent", "1", stdin="carol-password-1")  # fmt: skip
    assert added.code == 0, added.err
    first = run("key", "create", "--user", "carol").out.strip()
    second = run("key", "create", "--user", "carol").out.strip()
    headers = [{"x-api-key": first}, {"x-api-key": second}, {"x-api-key": first}]
    window_started = time.monotonic()
    for header in headers:
        answer = httpx.get(f"{server.base_url}/v1/models", headers=header, timeout=30)
        assert answer.status_code == 200, answer.text
    over = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": second}, timeout=30)
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "rate_limited"
    assert "across all keys" in over.json()["error"]["message"]
    # The first of the three leaves the minute's window 60 s after it was made: no sooner.
    since_first = time.monotonic() - window_started
    assert 60 - since_first - 1 <= int(over.headers["retry-after"]) <= 60

    dave = run("user", "add", "dave", "--password-stdin", "--max-concurrent", "1",
               stdin="dave-password-1")  # fmt: skip
    assert dave.code == 0, dave.err
    one = run("key", "create", "--user", "dave").out.strip()
    two = run("key", "create", "--user", "dave").out.strip()
    assert chat(server, one, "trickle", max_tokens=1).status_code == 200  # started, warm
    streaming = threading.Event()
    finished: list[int] = []

    def long_stream() -> None:
        body = {"model": "trickle", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": f"Bearer {one}"}
        url = f"{server.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, headers=auth, json=body, timeout=60) as answer:
            for _ in answer.iter_lines():
                streaming.set()
            finished.append(answer.status_code)

    worker = threading.Thread(target=long_stream)
    worker.start()
    try:
        assert streaming.wait(30)
        busy = chat(server, two, "trickle", max_tokens=1)  # the other key: same user
        assert busy.status_code == 429
        assert busy.json()["error"]["code"] == "concurrency_limited"
        assert busy.headers["retry-after"] == "1"
    finally:
        worker.join(60)
    assert finished == [200]
    assert chat(server, two, "trickle", max_tokens=1).status_code == 200  # released


# --- the rule itself, in the one service function --------------------------------------


@pytest.fixture
def models(db) -> None:
    add_engine("v1", kind="vllm", command="/opt/vllm/bin/vllm")
    for name in ("a", "b"):
        add_deployment(DeploymentSpec(name=name, engine="v1", source=f"/models/{name}"))


def test_keys_take_the_ceilings_they_leave_out(bob, alice, models):
    set_user_limits("bob", models=["a"], requests_per_minute=60, max_concurrent=2,
                    key_lifetime=timedelta(days=7))  # fmt: skip
    key, _ = issue_api_key("bob", actor="alice")  # whoever issues it
    assert [d.name for d in key.allowed_models.all()] == ["a"]
    assert (key.requests_per_minute, key.max_concurrent) == (60, 2)
    assert key.expires_at is not None
    assert key.expires_at <= timezone.now() + timedelta(days=7)
    with pytest.raises(UserError, match="bob may use only these models") as refused:
        update_api_key(key.key_id, models=["b"])
    assert refused.value.field == "models"
    with pytest.raises(UserError) as refused:
        update_api_key(key.key_id, expires_at=timezone.now() + timedelta(days=8))
    assert refused.value.field == "expires"
    key.refresh_from_db()
    assert (key.requests_per_minute, [d.name for d in key.allowed_models.all()]) == (60, ["a"])
    # Staff without ceilings are unlimited; a ceiling of "no models" leaves none.
    staff_key, _ = issue_api_key("alice", models=["b"], requests_per_minute=10_000)
    assert staff_key.requests_per_minute == 10_000
    set_user_limits("bob", models=[])
    with pytest.raises(UserError, match="may use only these models: none"):
        issue_api_key("bob", models=["a"])
    assert ApiKey.objects.filter(user=bob).count() == 1


def test_the_user_listing_reads_every_user_in_a_fixed_number_of_queries(
    cli, models, django_assert_max_num_queries
):
    from django.contrib.auth import get_user_model

    cli("user", "list")  # the first command sets up the database and the admin
    for n in range(8):
        get_user_model().objects.create_user(f"u{n}")
        set_user_limits(f"u{n}", models=["a", "b"][: n % 3], requests_per_minute=10 + n)
        issue_api_key(f"u{n}")
    with django_assert_max_num_queries(8):  # it was three a user and more
        listed = cli("user", "list", "--json")
    users = {u["name"]: u for u in json.loads(listed.out)}
    assert users["u4"]["keys"] == 1
    assert users["u4"]["limits"]["models"] == ["a"]
    assert users["u4"]["limits"]["requests_per_minute"] == 14
    assert users["admin"]["limits"]["models"] is None
