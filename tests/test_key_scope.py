"""A key's reach never grows behind its owner's back, and the ways in stay cheap to guard.

- A key limited to some models stays limited when they are removed: it then allows none,
  where an empty list used to read as "every model".
- The admin's form for a user's ceilings refuses what the service refuses, on the field.
- Guessed keys on the REST API cost at most one database read each (the same guess
  again: none), and an address that keeps guessing is answered 429, as on ``/v1``; a real
  key gets in from that address all the same.
"""

from __future__ import annotations

import json
import secrets
import signal
import string
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.db import connection

from capyctl.access import guessing
from capyctl.access.models import ApiKey, UserLimits
from capyctl.access.services import issue_api_key
from tests.conftest import CliResult, Server, run_program, start_server, stop_server
from tests.test_user_ceilings import log_in

SIM = f"{sys.executable} -m hostagent.sim"
BOB_PASSWORD = "bob-password-1"


# --- removing a deployment never widens a key ----------------------------------------------


@pytest.fixture
def shop(program_env) -> Iterator[tuple[Server, Any]]:
    """A standalone server with one model, chat (simulated vLLM, never started)."""
    program_env["CAPYCTL_SIM_GPUS"] = "24GiB"

    def run(*argv: str, stdin: str | None = None) -> CliResult:
        return run_program(program_env, *argv, stdin=stdin)

    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    added = run("deployment", "add", "chat", "--engine", "sim", "--source", "m-chat",
                "--gpu-memory", "4GiB")  # fmt: skip
    assert added.code == 0, added.err
    assert run("user", "add", "bob", "--password-stdin", stdin=BOB_PASSWORD).code == 0
    server = start_server(program_env)
    try:
        yield server, run
    finally:
        stop_server(server, signal.SIGTERM)


def v1_models(server: Server, key: str) -> list[str]:
    answer = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": key}, timeout=30)
    assert answer.status_code == 200, answer.text
    return [m["id"] for m in answer.json()["data"]]


def test_removing_a_keys_only_model_leaves_it_no_model(shop):
    server, run = shop
    made = run("key", "create", "--user", "bob", "--name", "narrow", "--models", "chat")
    assert made.code == 0, made.err
    bobs_key = made.out.strip()
    everything = run("key", "create", "--user", "bob", "--name", "all").out.strip()
    assert v1_models(server, bobs_key) == ["chat"]

    assert run("deployment", "remove", "chat").code == 0
    added = run("deployment", "add", "code", "--engine", "sim", "--source", "m-code",
                "--gpu-memory", "4GiB", "--alias", "chat")  # fmt: skip
    assert added.code == 0, added.err

    # Within the key cache's refresh, on every surface.
    assert v1_models(server, everything) == ["code"]
    assert v1_models(server, bobs_key) == []
    for model in ("code", "chat"):  # by its name, and by an alias taking the old name
        answer = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {bobs_key}"},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "model_not_found"

    keys = {k["name"]: k for k in json.loads(run("key", "list", "--json").out)}
    assert (keys["narrow"]["models"], keys["narrow"]["all_models"]) == ([], False)
    assert (keys["all"]["models"], keys["all"]["all_models"]) == ([], True)
    rows = {line.split()[2]: line.split()[3] for line in run("key", "list").out.splitlines()[1:]}
    assert rows == {"narrow": "(none)", "all": "(all)"}

    # Bob's REST view and keys page say the same.
    browser = log_in(server, "bob", BOB_PASSWORD)
    rest = {k["name"]: k for k in browser.get("/api/keys/").json()["results"]}
    assert (rest["narrow"]["models"], rest["narrow"]["all_models"]) == ([], False)
    assert (rest["all"]["models"], rest["all"]["all_models"]) == ([], True)
    page = browser.get("/keys/").text
    assert "no model" in page


@pytest.mark.django_db
def test_editing_a_key_with_no_model_left_in_the_admin_keeps_it_so(admin_client, bob):
    from capyctl.deployments.services import DeploymentSpec, add_deployment, remove_deployment
    from capyctl.engines.services import add_engine

    add_engine("v1", kind="vllm", command="/opt/vllm/bin/vllm")
    add_deployment(DeploymentSpec(name="chat", engine="v1", source="/m/chat"))
    key, _ = issue_api_key("bob", name="app", models=["chat"])
    remove_deployment("chat")
    page = admin_client.get(f"/admin/access/apikey/{key.pk}/change/").content.decode()
    assert "Limit models" in page
    saved = admin_client.post(f"/admin/access/apikey/{key.pk}/change/", {"name": "renamed"})
    assert saved.status_code == 302
    key.refresh_from_db()
    assert (key.name, key.limit_models, list(key.allowed_models.all())) == ("renamed", True, [])


# --- the admin's form for a user's ceilings ------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("form", "field", "words"),
    [
        ({"key_lifetime": "0"}, "key_lifetime", "more than 0"),
        ({"key_lifetime": "-1 00:00:00"}, "key_lifetime", "more than 0"),
        ({"key_lifetime": "40000 00:00:00"}, "key_lifetime", "at most 100 years"),
        ({"requests_per_minute": "0"}, "requests_per_minute", "requests per minute"),
        ({"max_concurrent": "0"}, "max_concurrent", "concurrent requests"),
        ({"requests_per_minute": str(2**31)}, "requests_per_minute", "requests per minute"),
    ],
)
def test_the_admin_refuses_impossible_ceilings_on_the_field(admin_client, bob, form, field, words):
    page = admin_client.post("/admin/access/userlimits/add/", {"user": bob.pk, **form})
    assert page.status_code == 200  # the form again, not a 500
    errors = page.context["adminform"].form.errors
    assert field in errors, errors
    assert words in errors[field][0]
    assert not UserLimits.objects.exists()

    limits = UserLimits.objects.create(user=bob, requests_per_minute=5)
    page = admin_client.post(f"/admin/access/userlimits/{limits.pk}/change/", form)
    assert page.status_code == 200
    assert field in page.context["adminform"].form.errors
    limits.refresh_from_db()
    assert (limits.requests_per_minute, limits.key_lifetime) == (5, None)


@pytest.mark.django_db
def test_the_admin_key_form_refuses_a_zero_rate_on_the_field(admin_client, bob):
    page = admin_client.post("/admin/access/apikey/add/", {"user": bob.pk, "max_concurrent": 0})
    assert page.status_code == 200
    assert "max_concurrent" in page.context["adminform"].form.errors
    assert not ApiKey.objects.exists()


@pytest.mark.django_db
def test_a_fine_lifetime_is_saved_from_the_admin(admin_client, bob):
    page = admin_client.post("/admin/access/userlimits/add/",
                             {"user": bob.pk, "key_lifetime": "7 00:00:00"})  # fmt: skip
    assert page.status_code == 302, page.context["adminform"].form.errors
    assert UserLimits.objects.get(user=bob).key_lifetime == timedelta(days=7)


# --- guessed keys on the REST API ----------------------------------------------------------


class KeyReads:
    """Counts the queries that read API keys (this test's connection)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if '"access_apikey"' in sql and sql.lstrip().upper().startswith("SELECT"):
            with self._lock:
                self.count += 1
        return execute(sql, params, many, context)


def guessed_key() -> str:
    alphabet = string.ascii_lowercase + string.digits
    key_id = "".join(secrets.choice(alphabet) for _ in range(10))
    return f"capy_{key_id}_{secrets.token_urlsafe(32)}"


@pytest.fixture
def fresh_guards() -> Iterator[None]:
    """The REST API's memory of failures starts empty for each test."""
    from capyctl.api import auth

    auth.reset_guards()
    yield
    auth.reset_guards()


GUESSES = 2000


@pytest.mark.django_db
def test_guessed_admin_keys_on_rest_are_throttled_and_read_once_each(client, alice, fresh_guards):
    from capyctl.api import auth

    _, real = issue_api_key("alice", admin=True)
    reads = KeyReads()
    answers: dict[int, int] = {}
    with connection.execute_wrapper(reads):
        flood_started = time.monotonic()
        for _ in range(GUESSES):
            answer = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}",
                                REMOTE_ADDR="203.0.113.7")  # fmt: skip
            answers[answer.status_code] = answers.get(answer.status_code, 0) + 1
        during = reads.count
        # The throttle lets one more failure through every refill: a slow machine's flood
        # lasts longer and earns a few more, never one per guess.
        refilled = int((time.monotonic() - flood_started) / guessing.FAILURE_REFILL_SECONDS) + 1
        throttled = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}",
                               REMOTE_ADDR="203.0.113.7")  # fmt: skip
        throttled_at = time.monotonic()
        left = auth._failures.wait(guessing.address_key("203.0.113.7"))
        wrong_secret = real[:-3] + ("aaa" if not real.endswith("aaa") else "bbb")
        still_throttled = client.get("/api/deployments/",
                                     HTTP_AUTHORIZATION=f"Bearer {wrong_secret}",
                                     REMOTE_ADDR="203.0.113.7")  # fmt: skip
        # A loaded machine may take a whole refill between the two: one failure is earned.
        refill_passed = time.monotonic() - throttled_at >= guessing.FAILURE_REFILL_SECONDS
        # Right away (within one refill of the throttle): a real key is untouched by the
        # flood, from another address and from the flooding one once it has passed there
        # (checked in memory before the lookup), while a wrong secret there is still 429.
        ok = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {real}",
                        REMOTE_ADDR="192.0.2.1")  # fmt: skip
        ok_there = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {real}",
                              REMOTE_ADDR="203.0.113.7")  # fmt: skip
        # The same guess again and again, from many addresses: read once, then remembered.
        again = guessed_key()
        reads.count = 0
        for n in range(200):
            answer = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {again}",
                                REMOTE_ADDR=f"198.51.100.{n}")  # fmt: skip
            assert answer.status_code in (401, 403), answer.content
        repeated = reads.count
    # Throttled or not, a well-formed key is looked up (a real one must get in): one
    # indexed read a guess at most, never more.
    assert during <= GUESSES + 2, (during, refilled)
    assert answers.get(429, 0) >= GUESSES - guessing.FAILURES_ALLOWED - refilled - 2, answers
    assert throttled.status_code == 429
    # The header is the throttle's own wait, rounded up (not a constant).
    assert left <= int(throttled.headers["Retry-After"]) < left + 1.5
    assert repeated == 1, repeated
    assert ok.status_code == 200, ok.content
    assert ok_there.status_code == 200, ok_there.content
    if refill_passed and still_throttled.status_code == 401:
        return  # the refill came before the check: nothing left to show about Retry-After
    assert still_throttled.status_code == 429
    # Retry-After is true: once it has passed, the flooding address may fail once more.
    time.sleep(int(still_throttled.headers["Retry-After"]))
    after = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}",
                       REMOTE_ADDR="203.0.113.7")  # fmt: skip
    assert after.status_code in (401, 403), after.content


@pytest.mark.django_db
def test_malformed_keys_on_rest_are_refused_without_a_read(client, alice, fresh_guards):
    reads = KeyReads()
    with connection.execute_wrapper(reads):
        for bad in ("capy_short_x", "capy_" + "A" * 10 + "_" + "x" * 43, "capy_" + "a" * 200):
            answer = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {bad}")
            assert answer.status_code in (401, 403)
    assert reads.count == 0


@pytest.mark.django_db(transaction=True)
def test_keys_that_named_models_stay_limited_after_the_upgrade(bob):
    from django.db.migrations.executor import MigrationExecutor

    from capyctl.deployments.services import DeploymentSpec, add_deployment
    from capyctl.engines.services import add_engine

    add_engine("v1", kind="vllm", command="/opt/vllm/bin/vllm")
    chat = add_deployment(DeploymentSpec(name="chat", engine="v1", source="/m/chat"))
    before, after = [("access", "0002_user_limits")], [("access", "0003_key_model_scope")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps.get_model("access", "ApiKey")
    narrow = old.objects.create(key_id="narrow0000", secret_hmac="x", user_id=bob.pk)
    narrow.allowed_models.add(chat.pk)
    old.objects.create(key_id="everything", secret_hmac="y", user_id=bob.pk)
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(after)
    # And on to this code's schema: the tests after this one in this process need it.
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    scope = dict(ApiKey.objects.values_list("key_id", "limit_models"))
    assert scope == {"narrow0000": True, "everything": False}


@pytest.mark.django_db
def test_a_real_admin_key_never_used_gets_in_on_rest_from_a_throttled_address(
    client, alice, fresh_guards
):
    """REST shares the guards: bad keys from a shared address slow the guessing there, not
    an admin key's first use from the same address."""
    _, real = issue_api_key("alice", admin=True)
    here = "203.0.113.70"
    statuses = [
        client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}",
                   REMOTE_ADDR=here).status_code
        for _ in range(30)
    ]  # fmt: skip
    assert statuses[-1] == 429
    wrong = f"{real[:-1]}{'A' if real[-1] != 'A' else 'B'}"
    assert client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {wrong}",
                      REMOTE_ADDR=here).status_code == 429  # fmt: skip
    ok = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {real}", REMOTE_ADDR=here)
    assert ok.status_code == 200, ok.content
    again = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}",
                       REMOTE_ADDR=here)  # fmt: skip
    assert again.status_code == 429  # the guessing there is still slowed


@pytest.mark.django_db
def test_rest_refuses_an_unknown_id_and_a_wrong_secret_with_the_same_work(
    client, alice, fresh_guards, monkeypatch
):
    """Whether an id exists must not show in the work REST does to refuse its key: each
    is hashed and compared, read once, then answered from memory, the same for both."""
    from capyctl import secret_hashing
    from capyctl.access import services

    _, real = issue_api_key("alice", admin=True)
    wrong = f"{real[:-1]}{'A' if real[-1] != 'A' else 'B'}"
    hashed: list[str] = []
    hash_secret = secret_hashing.hash_secret

    def counted_hash(secret: str) -> str:
        hashed.append(secret)
        return hash_secret(secret)

    monkeypatch.setattr(services, "hash_secret", counted_hash)
    reads = KeyReads()
    work: dict[str, list[tuple[int, int]]] = {}
    with connection.execute_wrapper(reads):
        for name, presented in (("unknown id", guessed_key()), ("wrong secret", wrong)):
            for n in range(3):
                before = reads.count, len(hashed)
                answer = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {presented}",
                                    REMOTE_ADDR=f"198.51.100.{n}")  # fmt: skip
                assert answer.status_code == 401, answer.content
                work.setdefault(name, []).append((reads.count - before[0],
                                                  len(hashed) - before[1]))  # fmt: skip
    # (reads, HMACs) for each of the three asks: the first reads, the others remember.
    assert work["unknown id"] == work["wrong secret"] == [(1, 1), (0, 1), (0, 1)], work
    ok = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {real}")
    assert ok.status_code == 200  # no one's wrong secret holds back the right one


@pytest.mark.django_db
def test_an_admin_key_past_its_users_key_lifetime_stops_working_on_rest(
    client, alice, fresh_guards
):
    """REST checks a key's time as /v1 does: its user's longest key lifetime binds keys
    made before it was set."""
    from django.utils import timezone

    from capyctl.access.services import set_user_limits

    key, real = issue_api_key("alice", admin=True)
    ApiKey.objects.filter(pk=key.pk).update(created_at=timezone.now() - timedelta(days=2))
    bearer = {"HTTP_AUTHORIZATION": f"Bearer {real}"}
    assert client.get("/api/deployments/", **bearer).status_code == 200
    set_user_limits("alice", key_lifetime=timedelta(days=1))
    assert client.get("/api/deployments/", **bearer).status_code == 401
