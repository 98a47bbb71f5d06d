"""Budgets (docs/budgets.md): every budget that applies to a request must have room; a
request reserves its worst case on admission and settles to what it used; what it used is
measured (tokens from the engine's usage, streams included; GPU-seconds shared among the
requests on an engine, plus shares of the switch waited for)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import zoneinfo
from datetime import datetime, timedelta
from typing import Any, cast

import httpx
import openai
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from openai.types.chat import ChatCompletionMessageParam

from capyctl.access import budgets as rules
from capyctl.access.models import ApiKey, Budget, Usage
from capyctl.events.models import Event
from capyctl.gateway.budgets import Budgets, LocalCounts, RedisCounts
from capyctl.gateway.cost import EngineShares
from capyctl.gateway.keys import KeyInfo
from capyctl.gateway.routing import Route
from capyctl.gateway.usage import UsageStrip
from capyctl.scheduler import switches
from tests.scheduling import SIM, SIM_ENV, deployment

pytestmark = pytest.mark.database  # on PostgreSQL too: the sums, the conditional updates


def _route(gpus: tuple[int, ...] = (0,)) -> Route:
    return Route(
        deployment_id=1, name="chat", desired_state="ready", observed_state="ready",
        parked_mode="", host="local", base_url="http://127.0.0.1:9", tls_name=None,
        host_state="online", launch_key="k", max_waiting=8, max_queue_seconds=30,
        ceilings=(), media_domains=frozenset(), gpus=gpus,
    )  # fmt: skip


def _key(key: ApiKey) -> KeyInfo:
    return KeyInfo(pk=key.pk, key_id=key.key_id, secret_hmac="", active=True, models=None,
                   requests_per_minute=None, user_id=key.user_id, team_id=key.team_id)  # fmt: skip


# --- periods -------------------------------------------------------------------------------


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_periods_are_calendar_periods_in_the_configured_time_zone(settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "TIME_ZONE": "Europe/Paris"}
    # 2026-03-29 is the day Paris moves its clocks forward: 23 hours long.
    start, end = rules.period_bounds("day", _at("2026-03-29T12:00:00+02:00"))
    assert (start.isoformat(), end and end.isoformat()) == (
        "2026-03-28T23:00:00+00:00", "2026-03-29T22:00:00+00:00"
    )  # fmt: skip
    start, end = rules.period_bounds("week", _at("2026-12-06T23:59:00+01:00"))  # a Sunday
    assert start.isoformat() == "2026-11-29T23:00:00+00:00"  # Monday 00:00 in Paris
    assert end is not None
    assert end.isoformat() == "2026-12-06T23:00:00+00:00"
    start, end = rules.period_bounds("month", _at("2026-12-31T23:30:00+01:00"))
    assert (start.isoformat(), end and end.isoformat()) == (
        "2026-11-30T23:00:00+00:00", "2026-12-31T23:00:00+00:00"
    )  # fmt: skip
    settings.CAPYCTL = {**settings.CAPYCTL, "TIME_ZONE": "Asia/Kathmandu"}  # UTC+05:45
    start, _ = rules.period_bounds("day", _at("2026-12-04T10:00:00+00:00"))
    assert start.isoformat() == "2026-12-03T18:15:00+00:00"
    assert start.timestamp() % rules.QUARTER == 0  # a usage row's quarter hour begins it
    assert rules.period_bounds("total")[1] is None


def test_a_bad_time_zone_stops_the_start_in_one_line():
    from capyctl.conf import ConfigError, env_time_zone

    with pytest.raises(ConfigError, match=r"CAPYCTL_TIME_ZONE='Mars/Olympus' is no time zone"):
        env_time_zone("CAPYCTL_TIME_ZONE", "UTC", {"CAPYCTL_TIME_ZONE": "Mars/Olympus"})


# --- what a request costs ------------------------------------------------------------------


def test_an_engine_s_gpu_time_is_shared_among_the_requests_in_flight(monkeypatch):
    """Two GPUs; a alone for 1 s, then a and b together for 2 s, then b alone for 1 s:
    a is charged 2 + 2 = 4 GPU-seconds, b 2 + 2 = 4; the engine's 8 in all."""
    now = [100.0]
    monkeypatch.setattr("capyctl.gateway.cost.time.monotonic", lambda: now[0])
    shares = EngineShares()
    a = shares.begin(1, 2)
    now[0] += 1
    b = shares.begin(1, 2)
    now[0] += 2
    assert shares.end(a) == pytest.approx(4.0)
    now[0] += 1
    assert shares.end(b) == pytest.approx(4.0)
    assert shares.typical(1) == pytest.approx(4.0)


def test_a_switch_s_seconds_are_its_steps_not_the_wait_before_them():
    said = "parked a (ram) 412 ms; stopped c 15 ms; woke b 688 ms"
    assert switches.seconds(said) == pytest.approx(1.115)
    assert switches.seconds("started b 2300 ms") == pytest.approx(2.3)
    assert switches.seconds("unloaded adapter a; loaded adapter b 58 ms") == pytest.approx(0.058)
    assert switches.seconds("") == 0


def test_the_usage_chunk_a_client_did_not_ask_for_is_taken_out_as_it_streams():
    strip = UsageStrip()
    events = [
        b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    out = b"".join(strip.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + strip.rest()
    assert out == events[0] + events[2]


# --- the rule, under concurrency -----------------------------------------------------------


async def _fifty_at_once(budgets_of: list[Budgets], key: KeyInfo) -> tuple[int, int, list[str]]:
    """Fifty requests at once, each reserving 100 tokens (a 40-byte body: 10 tokens, and
    90 to generate), spread over ``budgets_of`` (API processes); each that is let in
    uses its 100 tokens after a little while. Returns (let in, tokens used, refusals)."""
    route, body = _route(), {"max_tokens": 90}
    let_in, used, refusals = 0, 0, []

    async def one(budgets: Budgets) -> None:
        nonlocal let_in, used
        from capyctl.gateway.errors import GatewayError

        try:
            reservation = await budgets.admit(key, route, body, 40, None)
        except GatewayError as refused:
            refusals.append(f"{refused.code}: {refused.message}")
            return
        assert reservation is not None
        assert reservation.need[0] == 100
        let_in += 1
        await asyncio.sleep(random.uniform(0.01, 0.05))  # noqa: S311 - a spread, not a secret
        used += 100
        await budgets.settle(reservation, (100, 0.0, 0.0))

    await asyncio.gather(*(one(budgets_of[i % len(budgets_of)]) for i in range(50)))
    return let_in, used, refusals


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("processes", ["standalone", "server"])
async def test_fifty_at_once_against_room_for_ten_pass_it_by_at_most_one(
    processes, bob, database_threads, request
):
    """A budget of 1,000 tokens with 1 used: room for ten requests of 100 (nine, and a
    tenth that passes it by 1 token). Standalone (one process, its own counts) and server
    mode (two API processes counting in Redis): ten let in, forty refused, 1,001 used."""
    from capyctl.access.services import issue_api_key

    def set_up() -> ApiKey:
        key = issue_api_key("bob")[0]
        Usage.objects.create(at=rules.quarter_of(time.time()), key=key, model="chat",
                             requests=1, completion_tokens=1)  # fmt: skip
        rules.set_budget(key=key.key_id, tokens=1000, period="day")
        return key

    key = await sync_to_async(set_up)()
    if processes == "server":
        url = request.getfixturevalue("redis_url")
        budgets_of = [Budgets(url), Budgets(url)]
    else:
        budgets_of = [Budgets(None)]
    from capyctl.gateway.errors import GatewayError

    try:
        let_in, used, refusals = await _fifty_at_once(budgets_of, _key(key))
        assert (let_in, used) == (10, 1000)
        # What the counts themselves hold (in this process, or in Redis): 1 + 1,000 used,
        # past the ceiling by 1 token, less than one reservation (100).
        for budgets in budgets_of:
            with pytest.raises(GatewayError, match=r"is used up: 1,001 of 1,000 tokens"):
                await budgets.admit(_key(key), _route(), {"max_tokens": 90}, 40, None)
    finally:
        for budgets in budgets_of:
            await budgets.close()
    assert (let_in, len(refusals)) == (10, 40)
    assert all(r.startswith("budget_exceeded: Key capy_") for r in refusals), refusals[:3]
    assert any("is held by requests in flight" in r for r in refusals)


def test_a_budget_is_never_reserved_in_when_another_that_applies_has_no_room():
    """A key's budget has room, its team's has none: the request is refused, and the key's
    budget holds no reservation of it (one step, all or nothing)."""
    counts = LocalCounts()
    roomy = rules_line(1, tokens=1000)
    full = rules_line(2, tokens=100, seed=100)
    assert counts.reserve([(roomy, 0.0), (full, 0.0)], (50, 1, 0)) == (1, 0, 100.0, 0.0)
    assert counts.reserve([(roomy, 0.0)], (950, 1, 0)) is None  # all of roomy's 1,000 free


def rules_line(pk: int, *, tokens: int, seed: int = 0) -> Any:
    from capyctl.gateway.budgets import BudgetLine

    return BudgetLine(pk=pk, scope=("key", pk), period="total", ceilings=(tokens, None, None),
                      soft_percent=None, words=f"budget {pk}", seed=(seed, 0.0, 0.0),
                      seed_start=0.0)  # fmt: skip


# --- as a new user would ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("gpu24", "alice", "bob", "database_threads")
async def test_a_team_s_daily_budget_runs_out_and_the_next_day_lets_them_in(monkeypatch, cli):
    """A team with a 1,000-token daily budget; alice and bob in it, each with a key
    charged to it. Through the official openai client: answered until the team's budget
    is used up, then 429 budget_exceeded naming the team's budget, what was used and when
    it resets; alice's key charged to no team still answered; the next day (a test clock)
    lets them in again. The usage rows and `capyctl budget list` say what was used."""
    from capyctl.gateway.app import Gateway

    today = time.time()
    monkeypatch.setattr(rules, "clock", lambda: today)

    def set_up() -> None:
        from capyctl.engines.services import add_engine

        wordy = {**SIM_ENV, "CAPYCTL_SIM_COMPLETION_TOKENS": "100"}
        add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=wordy)
        deployment("chat")
        for line in (
            ["team", "add", "research"],
            ["team", "member", "add", "research", "alice"],
            ["team", "member", "add", "research", "bob"],
            ["budget", "set", "--team", "research", "--tokens", "1000", "--period", "day"],
        ):
            assert cli(*line).code == 0, line

    await sync_to_async(set_up)()
    keys = {}
    for name, user, team in (("alice-lab", "alice", "research"), ("bob-lab", "bob", "research"),
                             ("alice-own", "alice", None)):  # fmt: skip
        made = await sync_to_async(cli)("key", "create", "--user", user,
                                        *(["--team", team] if team else []))  # fmt: skip
        keys[name] = made.out.strip()
    gateway = Gateway()
    transport = httpx.ASGITransport(app=cast("Any", gateway))
    try:

        def client(name: str) -> openai.AsyncOpenAI:
            http = httpx.AsyncClient(transport=transport, base_url="http://testserver")
            return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=keys[name],
                                      http_client=cast("Any", http), max_retries=0)  # fmt: skip

        ask: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Say hello to the whole team, please."}
        ]
        answered = 0
        refused = None
        for turn in range(40):
            who = client("alice-lab" if turn % 2 else "bob-lab")
            try:
                await who.chat.completions.create(model="chat", messages=ask, max_tokens=64)
                answered += 1
            except openai.RateLimitError as exc:
                refused = exc
                break
        assert refused is not None, "the budget never ran out"
        body = refused.body
        assert isinstance(body, dict), body
        assert body["code"] == "budget_exceeded", body
        assert body["message"].startswith("Team research's daily budget is used up: ")
        assert body["message"].endswith(" of 1,000 tokens; it resets at "
                                        f"{rules.period_bounds('day', today)[1]:%Y-%m-%d} "
                                        "00:00 UTC.")  # fmt: skip
        wait = int(refused.response.headers["retry-after"])
        ends = rules.period_bounds("day", today)[1]
        assert ends is not None
        assert wait == min(max(math.ceil(ends.timestamp() - today), 1), 3600)  # capped
        # Streams count too: the engine is asked for its usage chunk, the client that did
        # not ask for it does not get it, and alice's own key has no team and no budget.
        stream = await client("alice-own").chat.completions.create(
            model="chat", messages=ask, max_tokens=8, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert chunks
        assert all(chunk.usage is None for chunk in chunks)
        assert all(chunk.choices for chunk in chunks)
        # The next day: room again.
        monkeypatch.setattr(rules, "clock", lambda: today + 86400)
        await asyncio.sleep(1.2)  # the gateway reads budgets afresh within a second
        again = await client("bob-lab").chat.completions.create(
            model="chat", messages=ask, max_tokens=8
        )
        assert again.choices[0].message.content
    finally:
        await gateway.close()

    def recorded() -> dict[str | None, int]:
        totals: dict[str | None, int] = {}
        for row in Usage.objects.select_related("team"):
            team = row.team.name if row.team else None
            totals[team] = totals.get(team, 0) + row.prompt_tokens + row.completion_tokens
        return totals

    totals = await sync_to_async(recorded)()
    assert totals["research"] >= 1000  # what ran it out, and the next day's request
    assert totals[None] > 0  # the stream's tokens, from the usage chunk the gateway asked for
    assert answered >= 5
    listing = await sync_to_async(cli)("budget", "list", "--json")
    (row,) = json.loads(listing.out)
    assert row["of"] == "research"
    assert row["tokens"] == 1000


@pytest.mark.django_db(transaction=True)
async def test_a_soft_line_is_said_once_a_period_with_the_webhook(
    bob, database_threads, settings, httpserver_url
):
    """80% of 1,000 tokens: crossed by the ninth request of 100; the event and the POST
    are made once, however many requests cross it after."""
    from capyctl.access.services import issue_api_key

    url, posts = httpserver_url
    settings.CAPYCTL = {**settings.CAPYCTL, "ALERT_WEBHOOK": url}

    def set_up() -> ApiKey:
        key = issue_api_key("bob")[0]
        rules.set_budget(key=key.key_id, tokens=1000, period="week", soft_percent=80)
        return key

    key = _key(await sync_to_async(set_up)())
    budgets = Budgets(None)
    try:
        for _ in range(10):
            reservation = await budgets.admit(key, _route(), {"max_tokens": 90}, 40, None)
            assert reservation is not None
            await budgets.settle(reservation, (100, 0.0, 0.0))
    finally:
        await budgets.close()
    events = [e async for e in Event.objects.filter(kind="budget.soft_crossed")]
    assert len(events) == 1
    assert events[0].message.startswith(
        f"key capy_{key.key_id}'s weekly budget passed its soft line (80%): 800 of 1,000"
    )
    assert len(posts) == 1
    assert posts[0]["event"] == "budget.soft_crossed"
    assert posts[0]["used_tokens"] == 800
    budget = await Budget.objects.aget()
    assert budget.soft_alerted_for == rules.period_bounds("week")[0]


@pytest.fixture
def httpserver_url():
    """A local HTTP server that keeps the JSON bodies POSTed to it."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    posts: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            posts.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/alerts", posts
    server.shutdown()


# --- GPU-seconds, switches included -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_switch_is_charged_to_the_requests_that_waited_for_it(gpu24, bob, database_threads):
    """b is parked in RAM behind a; three requests for b wait for its wake together: the
    switch's steps (a's park, b's wake) on b's GPU are shared among them, and a
    GPU-seconds budget counts them."""
    from capyctl.access.services import issue_api_key
    from capyctl.engines.services import add_engine
    from capyctl.gateway.app import Gateway
    from capyctl.scheduler import actions

    def set_up() -> str:
        slow = {**SIM_ENV, "CAPYCTL_SIM_WAKE_SECONDS": "0.6"}
        add_engine("sim-slow", kind="vllm", command=f"{SIM} vllm", env=slow)
        a, b = deployment("a", engine="sim-slow"), deployment("b", engine="sim-slow")
        actions.ensure_ready(b.pk)
        actions.ensure_ready(a.pk)  # b parks
        key, secret = issue_api_key("bob")
        rules.set_budget(key=key.key_id, gpu_seconds=1000, period="day")
        return secret

    secret = await sync_to_async(set_up)()
    gateway = Gateway()
    transport = httpx.ASGITransport(app=cast("Any", gateway))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver",
                                     timeout=60, headers={"Authorization": f"Bearer {secret}"}
                                     ) as client:  # fmt: skip
            body = {"model": "b", "messages": [{"role": "user", "content": "hi"}]}
            began = time.monotonic()
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(3))
            )
            took = time.monotonic() - began
    finally:
        await gateway.close()
    assert [a.status_code for a in answers] == [200, 200, 200], answers[0].text
    assert all("woke b" in a.headers.get("x-capyctl-switch", "") for a in answers)
    rows = [row async for row in Usage.objects.filter(model="b")]
    switch = sum(r.switch_gpu_seconds for r in rows)
    said = answers[0].headers["x-capyctl-switch"]  # "parked a (ram) 40 ms; woke b 612 ms"
    steps = switches.seconds(said)
    assert 0.6 <= steps <= took
    assert switch == pytest.approx(steps, abs=0.003)  # b's one GPU, three shares of it
    assert sum(r.requests for r in rows) == 3
    used = await sync_to_async(rules.used_of)(await Budget.objects.aget())
    assert used.gpu_seconds == pytest.approx(switch + sum(r.gpu_seconds for r in rows))


# --- the CLI and REST ----------------------------------------------------------------------


@pytest.mark.django_db
def test_budgets_are_set_listed_and_removed_in_one_line_each(cli, alice, bob):
    assert cli("team", "add", "ml").code == 0
    made = cli("budget", "set", "--team", "ml", "--tokens", "1000", "--period", "day",
               "--soft", "80")  # fmt: skip
    assert made.out == "budget 1 set: team ml's daily budget, 1,000 tokens (soft line 80%)\n"
    again = cli("budget", "set", "--team", "ml", "--tokens", "2000", "--period", "day")
    assert again.out == "budget 1 changed: team ml's daily budget, 2,000 tokens\n"
    assert (
        cli("budget", "set", "--user", "bob", "--gpu-seconds", "36", "--period", "total").code == 0
    )
    rows = json.loads(cli("budget", "list", "--json").out)
    assert [(r["scope"], r["of"], r["tokens"], r["gpu_seconds"]) for r in rows] == [
        ("team", "ml", 2000, None), ("user", "bob", None, 36.0)
    ]  # fmt: skip
    before = Budget.objects.count()
    for argv, said in (
        (["--team", "nope", "--tokens", "5", "--period", "day"], "no team named 'nope'"),
        (["--team", "ml", "--period", "day"],
         "give --tokens, --gpu-seconds, --spend or more of them"),
        (["--team", "ml", "--tokens", "5", "--period", "day", "--soft", "120"],
         "--soft must be a percentage from 1 to 100"),
    ):  # fmt: skip
        refused = cli("budget", "set", *argv)
        assert (refused.code, refused.err) == (2, f"capyctl: error: {said}\n"), argv
    assert cli("budget", "set", "--team", "ml", "--tokens", "0", "--period", "day").code == 2
    assert Budget.objects.count() == before
    assert cli("budget", "remove", "1").out == "budget 1 removed\n"
    assert cli("budget", "remove", "1").err == "capyctl: error: no budget 1\n"
    assert [r["of"] for r in json.loads(cli("budget", "list", "--json").out)] == ["bob"]


def _two_users_used(*, switch_gpu_seconds: float) -> tuple[ApiKey, ApiKey]:
    """Bob's key charged to team ml used chat (40 tokens), alice's of no team code (10):
    the two keys."""
    from capyctl.access.services import issue_api_key
    from capyctl.access.teams import add_member, add_team

    add_team("ml")
    add_member("ml", "bob")
    bob_key = issue_api_key("bob", team="ml")[0]
    alice_key = issue_api_key("alice")[0]
    at = rules.quarter_of(time.time())
    Usage.objects.create(at=at, key=bob_key, team=bob_key.team, model="chat", requests=2,
                         prompt_tokens=10, completion_tokens=30, gpu_seconds=1.5)  # fmt: skip
    Usage.objects.create(at=at, key=alice_key, model="code", requests=1, prompt_tokens=5,
                         completion_tokens=5, gpu_seconds=0.5,
                         switch_gpu_seconds=switch_gpu_seconds)  # fmt: skip
    return bob_key, alice_key


@pytest.mark.django_db
def test_rest_budgets_for_staff_and_usage_for_everyone_their_own(client, alice, bob):
    bob_key, _ = _two_users_used(switch_gpu_seconds=0.25)
    client.force_login(alice)
    made = client.post("/api/budgets/", {"team": "ml", "tokens": 100, "period": "month"},
                       content_type="application/json")  # fmt: skip
    assert made.status_code == 201, made.content
    assert made.json()["used_tokens"] == 40
    bad = client.post("/api/budgets/", {"team": "ml", "period": "month"},
                      content_type="application/json")  # fmt: skip
    assert bad.status_code == 400
    assert client.get("/api/budgets/").json()[0]["of"] == "ml"
    by_model = client.get("/api/usage/?by=model&since=1d").json()
    assert [(r["name"], r["tokens"], r["gpu_seconds"]) for r in by_model] == [
        ("chat", 40, 1.5), ("code", 10, 0.75)
    ]  # fmt: skip
    assert client.get("/api/usage/?by=nothing").status_code == 400
    assert client.delete(f"/api/budgets/{made.json()['id']}/").status_code == 204
    client.force_login(User.objects.get(username="bob"))
    assert client.get("/api/budgets/").status_code == 403
    own = client.get("/api/usage/?by=key").json()
    assert [r["name"] for r in own] == [bob_key.key_id]


@pytest.mark.django_db(transaction=True)  # a scrape closes its connection
def test_metrics_show_tokens_and_gpu_seconds_by_team_and_each_budget_s_share(alice, bob):
    from prometheus_client.parser import text_string_to_metric_families

    from capyctl.access.services import issue_api_key
    from capyctl.access.teams import add_member, add_team
    from capyctl.web.metrics import _scrape

    add_team("ml")
    add_member("ml", "bob")
    key = issue_api_key("bob", team="ml")[0]
    Usage.objects.create(at=rules.quarter_of(time.time()), key=key, team=key.team, model="chat",
                         requests=3, prompt_tokens=100, completion_tokens=300, gpu_seconds=2.0,
                         switch_gpu_seconds=0.5)  # fmt: skip
    rules.set_budget(team="ml", tokens=1000, period="day")
    rules.set_budget(key=key.key_id, gpu_seconds=10, period="total")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(_scrape().decode())
        for s in family.samples
    }
    labels = (("direction", "completion"), ("model", "chat"), ("team", "ml"))
    assert samples[("capyctl_tokens_total", labels)] == 300
    assert samples[("capyctl_gpu_seconds_total", (("model", "chat"), ("team", "ml")))] == 2.5
    assert samples[("capyctl_budget_used_ratio", (("budget", "team:ml:day"),))] == 0.4
    ratio = samples[("capyctl_budget_used_ratio", ((("budget", f"key:capy_{key.key_id}:total")),))]
    assert ratio == 0.25


# --- outages -------------------------------------------------------------------------------


async def _spend(budgets: Budgets, key: KeyInfo, written: list[int]) -> int:
    """Requests of 100 tokens, one after another, until the budget refuses one; each is
    answered or refused, never failed. ``written``: its usage, as the database gets it.
    Returns how many were let in."""
    from capyctl.gateway.errors import GatewayError

    let_in = 0
    while True:
        try:
            reservation = await budgets.admit(key, _route(), {"max_tokens": 90}, 40, None)
        except GatewayError as refused:
            codes = {refused.code}
            assert codes == {"budget_exceeded"}
            return let_in
        assert reservation is not None
        await budgets.settle(reservation, (100, 0.0, 0.0))
        written.append(100)
        let_in += 1


@pytest.mark.django_db(transaction=True)
async def test_a_redis_outage_counts_in_each_process_and_gives_back_what_it_counted(
    bob, database_threads, own_redis
):
    """Two API processes, a key's budget of 1,000 tokens, 300 used through Redis. Redis is
    cut off (a partition: its data kept): each process counts alone from the database's
    sum, so each lets in the 700 it sees left (stated in docs/budgets.md); once Redis
    answers, each gives back what it counted (1,000, then 1,700 used).
    Redis then restarted empty: a process's counts begin again from the database's sum."""
    from capyctl.access.services import issue_api_key
    from capyctl.gateway.errors import GatewayError
    from capyctl.scheduler import gateway_api
    from tests.own_servers import PausableProxy

    proxy = PausableProxy(own_redis.port)
    url = proxy.url()

    def set_up() -> ApiKey:
        key = issue_api_key("bob")[0]
        rules.set_budget(key=key.key_id, tokens=1000, period="day")
        return key

    row = await sync_to_async(set_up)()
    key = _key(row)
    written: list[int] = []

    def write() -> None:  # the usage rows the gateway writes within a second
        Usage.objects.create(at=rules.quarter_of(time.time()), key=row, model="chat",
                             requests=len(written), completion_tokens=sum(written))  # fmt: skip
        written.clear()

    first, second = Budgets(url), Budgets(url)
    try:
        for _ in range(3):
            reservation = await first.admit(key, _route(), {"max_tokens": 90}, 40, None)
            assert reservation is not None
            await first.settle(reservation, (100, 0.0, 0.0))
            written.append(100)
        await sync_to_async(write)()
        await first._refresh()
        await second._refresh()
        proxy.pause()
        assert await _spend(first, key, written) == 7
        assert await _spend(second, key, written) == 7
        await sync_to_async(write)()
        proxy.resume()
        gateway_api.redis_link(url).answered()  # back (a background call would say so)
        for budgets, used in ((first, "1,000"), (second, "1,700")):  # each gives its own back
            with pytest.raises(GatewayError, match=f"is used up: {used} of 1,000 tokens"):
                await budgets.admit(key, _route(), {"max_tokens": 90}, 40, None)
        own_redis.stop()
        own_redis.start()  # empty
        gateway_api.redis_link(url).answered()
        third = Budgets(url)  # a process (re)started with Redis: no count of its own
        try:
            with pytest.raises(GatewayError, match="is used up: 1,700 of 1,000 tokens"):
                await third.admit(key, _route(), {"max_tokens": 90}, 40, None)
        finally:
            await third.close()
    finally:
        await first.close()
        await second.close()
        proxy.close()


@pytest.mark.django_db
def test_the_usage_page_shows_staff_everything_and_a_user_their_own(client, alice, bob):
    _, alice_key = _two_users_used(switch_gpu_seconds=0.0)
    rules.set_budget(team="ml", tokens=100, period="day")
    client.force_login(alice)
    page = client.get("/usage/?days=7").content.decode()
    assert page.count('class="bar"') == 4  # two teams (ml, none) on each chart, today
    assert 'data-series="ml"' in page
    assert 'data-value="40.000"' in page
    assert "40 of 100 tokens" in page
    client.force_login(bob)
    page = client.get("/usage/?days=not-a-number").content.decode()
    assert page.count('class="bar"') == 2  # only ml's
    assert alice_key.key_id not in page
    assert "40 of 100 tokens" in page  # his team's budget
    client.logout()
    assert client.get("/usage/").status_code == 302  # to log in


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("gpu24", "database_threads")
async def test_a_spend_budget_counts_tokens_and_gpu_time_at_the_model_s_prices(bob, cli):
    """A model priced at 2 a million prompt tokens, 10 a million completion tokens and 36
    a GPU-hour (a hundredth a GPU-second); a key with a budget of 0.01 to spend: each
    request's spend is its tokens and GPU-seconds at those prices, and the budget refuses
    once they add up to it."""
    from capyctl.access.services import issue_api_key
    from capyctl.engines.services import add_engine
    from capyctl.gateway.app import Gateway

    def set_up() -> str:
        wordy = {**SIM_ENV, "CAPYCTL_SIM_COMPLETION_TOKENS": "100"}
        add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=wordy)
        deployment("chat", price_prompt=2, price_completion=10, price_gpu_hour=36)
        key, secret = issue_api_key("bob")
        assert cli("budget", "set", "--key", key.key_id, "--spend", "0.01",
                   "--period", "month").code == 0  # fmt: skip
        return secret

    secret = await sync_to_async(set_up)()
    gateway = Gateway()
    transport = httpx.ASGITransport(app=cast("Any", gateway))
    statuses = []
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver",
                                     timeout=60, headers={"Authorization": f"Bearer {secret}"}
                                     ) as client:  # fmt: skip
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(20):
                answer = await client.post("/v1/chat/completions", json=body)
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    refusal = answer.json()["error"]
                    break
    finally:
        await gateway.close()
    assert statuses[-1] == 429
    assert refusal["code"] == "budget_exceeded"
    assert " to spend; it resets at " in refusal["message"]
    rows = [row async for row in Usage.objects.all()]
    for row in rows:
        priced = (row.prompt_tokens * 2 + row.completion_tokens * 10) / 1e6 + (
            row.gpu_seconds + row.switch_gpu_seconds
        ) / 100
        assert row.spend == pytest.approx(priced)
    spent = sum(row.spend for row in rows)
    assert spent >= 0.01  # used up, by less than one request's reservation past it
    assert sum(row.requests for row in rows) == len(statuses) - 1


def test_a_day_whose_midnight_comes_twice_begins_at_its_first(settings):
    """Havana turns its clocks back at 01:00 to 00:00 on 2025-11-02: the day's start is
    the same at 00:30 before the change, at 00:30 after it, and at noon."""
    zone = zoneinfo.ZoneInfo("America/Havana")
    noon = datetime(2025, 11, 2, 12, 0, tzinfo=zone).timestamp()
    first = datetime(2025, 11, 2, 0, 30, tzinfo=zone, fold=0).timestamp()
    second = datetime(2025, 11, 2, 0, 30, tzinfo=zone, fold=1).timestamp()
    assert second - first == timedelta(hours=1).total_seconds()
    settings.CAPYCTL = {**settings.CAPYCTL, "TIME_ZONE": "America/Havana"}
    starts = {rules.period_bounds("day", moment)[0] for moment in (first, second, noon)}
    assert len(starts) == 1, starts


@pytest.mark.django_db(transaction=True)
def test_usage_of_a_key_removed_while_in_flight_does_not_hold_up_the_rest(bob, alice):
    """A user removed while their request was in flight: that usage is left out, the
    rest of the batch is written (the batch once failed whole, every second, for good)."""
    from capyctl.access.services import issue_api_key, remove_user
    from capyctl.access.teams import add_member, add_team
    from capyctl.gateway.usage import UsageBook, write_usage

    add_team("ml")
    add_member("ml", "alice")
    gone = issue_api_key("bob")[0]
    stays = issue_api_key("alice", team="ml")[0]
    book = UsageBook()
    book.add(gone.pk, 1, 2, model="chat")
    book.add(stays.pk, 3, 4, model="chat", team_id=stays.team_id)
    book.add(stays.pk, 5, 6, model="chat", team_id=987654)  # a team removed meanwhile
    remove_user("bob")
    write_usage(book.take())
    rows = sorted((r.prompt_tokens, r.key_id, r.team_id) for r in Usage.objects.all())
    assert rows == [(3, stays.pk, stays.team_id), (5, stays.pk, None)]


async def test_a_settle_given_back_after_it_ran_counts_nothing_twice(redis_url):
    """Redis ran a settle but its answer did not arrive (a timeout), so it is given back
    once Redis answers: the hold is taken back once and the usage counted once; and a
    reserve that ran unanswered has its hold taken back by its settle."""
    budgets = Budgets(redis_url)
    counts = budgets.counts
    assert isinstance(counts, RedisCounts)
    line = rules_line(1, tokens=1000)
    try:
        reservation = await budgets_reserve(counts, line)
        await counts._settle_there(reservation, (100, 0, 0), time.time())
        after = await counts._settle_there(reservation, (100, 0, 0), time.time())  # again
        assert after == [(100.0, 0.0, 0.0)]
        unanswered = await budgets_reserve(counts, line)  # ran; the caller counted locally
        unanswered.local = True
        after = await counts._settle_there(unanswered, (50, 0, 0), time.time())
        assert after == [(150.0, 0.0, 0.0)]
        held = await counts._redis.hget(_key_of(line), "r1")
        assert float(held) == 0.0  # both holds taken back, each once
    finally:
        await budgets.close()


async def budgets_reserve(counts: RedisCounts, line: Any) -> Any:
    from capyctl.gateway.budgets import Reservation

    reservation = Reservation([(line, 0.0)], (100.0, 0.0, 0.0))
    refused, local = await counts.reserve(reservation.lines, reservation.need, reservation.rid)
    assert (refused, local) == (None, False)
    return reservation


def _key_of(line: Any) -> str:
    return f"capyctl:budget:{line.pk}:0"


@pytest.mark.django_db
def test_the_budgets_sums_are_read_a_query_a_scope_and_period(
    bob, alice, django_assert_max_num_queries
):
    """Twenty keys' daily budgets, a user's and a team's: three queries give every sum
    (the gateway reads them each second; a query a budget grew with their number)."""
    from capyctl.access.services import issue_api_key
    from capyctl.access.teams import add_member, add_team

    add_team("ml")
    add_member("ml", "bob")
    at = rules.quarter_of(time.time())
    found = []
    for n in range(20):
        key = issue_api_key("bob", team="ml" if n % 2 else None)[0]
        Usage.objects.create(at=at, key=key, team=key.team, model="chat", requests=1,
                             prompt_tokens=n, completion_tokens=1, spend=0.5)  # fmt: skip
        found.append(rules.set_budget(key=key.key_id, tokens=100, period="day")[0])
    found.append(rules.set_budget(user="bob", tokens=1000, period="week")[0])
    found.append(rules.set_budget(team="ml", gpu_seconds=10, period="month")[0])
    with django_assert_max_num_queries(3):
        together = rules.used_of_many(found)
    alone = {budget.pk: rules.used_of(budget) for budget in found}
    assert together == alone
    assert together[found[5].pk] == rules.Used(tokens=6, gpu_seconds=0.0, spend=0.5)
    assert together[found[-2].pk].tokens == sum(range(20)) + 20
    assert together[found[-1].pk].spend == 5.0  # the ten keys charged to ml


def test_what_a_body_says_of_its_size_is_read_only_where_it_is_a_count():
    """A hostile body's ``max_tokens``, ``n`` and ``stream_options`` of the wrong types
    reserve as if absent (the model's ceiling), and never raise; a stream's options are
    kept, with include_usage added."""
    from capyctl.gateway.admission import _with_usage
    from capyctl.gateway.budgets import _worst_tokens
    from capyctl.gateway.context import Outcome

    route = _route()
    for hostile in ({"max_tokens": "9"}, {"max_tokens": True}, {"max_tokens": -5},
                    {"max_tokens": 1.5}, {"n": "3"}, {"n": True}):  # fmt: skip
        assert _worst_tokens(hostile, 40, route) == (10, 1024), hostile
    assert _worst_tokens({"max_tokens": 8, "n": 3}, 40, route) == (10, 24)
    outcome = Outcome()
    for options in ("x", ["include_usage"], None, {"include_usage": "yes"}):
        parsed = {"model": "chat", "stream": True, "stream_options": options}
        body, asked = _with_usage(b"{}", parsed, "/v1/chat/completions", outcome)
        assert asked["stream_options"]["include_usage"] is True
        assert json.loads(body) == asked
        assert outcome.strip_usage
    kept = {"model": "chat", "stream": True, "stream_options": {"include_usage": True}}
    fresh = Outcome()
    assert _with_usage(b"same", kept, "/v1/chat/completions", fresh) == (b"same", kept)
    assert not fresh.strip_usage  # the client asked for it: passed on


@pytest.mark.django_db
def test_usage_csv_never_starts_a_cell_a_spreadsheet_would_run(cli):
    """A username may begin with @, + or - (Django allows them): ``capyctl usage --csv``
    quotes such a cell so a spreadsheet shows it instead of running it."""
    from capyctl.access.services import issue_api_key

    for name in ("@SUM(1+1)", "+cmd", "-2"):
        User.objects.create_user(name, password="x-password-1")
        key = issue_api_key(name)[0]
        Usage.objects.create(at=rules.quarter_of(time.time()), key=key, model="chat",
                             requests=1, prompt_tokens=1)  # fmt: skip
    out = cli("usage", "--by", "user", "--csv").out.splitlines()
    assert out[0].startswith("user,requests,")
    assert sorted(line.split(",")[0] for line in out[1:]) == ["'+cmd", "'-2", "'@SUM(1+1)"]
