"""Request traces: what each /v1 request came to (never its body) is recorded off the
request path, kept within its bound, and exported as JSON Lines (docs/what-if.md)."""

import asyncio
import json
import logging
import re
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, connection
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext

from capyctl.access.services import issue_api_key
from capyctl.engines.services import add_engine
from capyctl.gateway.app import Gateway
from capyctl.scheduler import actions
from capyctl.traces.export import FIELDS, trace_lines
from capyctl.traces.models import RequestTrace
from capyctl.traces.recording import TraceBook, TraceWriter
from tests.scheduling import SIM, SIM_ENV, deployment, vllm_engine

AT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _ask(model: str, text: str, **extra: object) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def _client(gateway: Gateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=cast("Any", gateway)),
        base_url="http://testserver",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def _rows() -> list[dict[str, Any]]:
    return [model_to_dict(row) for row in RequestTrace.objects.order_by("at", "id")]


def _trace(at: datetime, model: str = "chat", status: int = 200, **given: Any) -> tuple[Any, ...]:
    """A trace as the gateway leaves it in its book."""
    fields = {"key": 7, "stream": False, "code": None, "queued": 0.0, "ttfb": 5.0,
              "duration": 9.0, "prompt": 3, "completion": 8, "switch": "", **given}  # fmt: skip
    return (at.timestamp(), model, fields["key"], fields["stream"], status, fields["code"],
            fields["queued"], fields["ttfb"], fields["duration"], fields["prompt"],
            fields["completion"], fields["switch"])  # fmt: skip


@pytest.mark.django_db(transaction=True)
async def test_served_streamed_and_refused_requests_are_traced_without_their_bodies(
    gpu24, bob, database_threads
):
    """Bob's first request starts chat and waits for it; his stream then is served at
    once; a request for a stopped model is refused. Each leaves a row with what it came
    to; a model no key may name, or a bad key, leaves none. No row and no exported line
    holds a word of what was asked or answered."""
    marker = f"capybara-{uuid.uuid4().hex}"

    def set_up() -> tuple[int, str]:
        vllm_engine()
        deployment("chat", gib=8)
        actions.stop(deployment("off", gib=8).pk)
        key, full = issue_api_key("bob")
        return key.pk, full

    key_pk, key = await sync_to_async(set_up)()
    gateway = Gateway()
    async with _client(gateway, key) as client:
        started = datetime.now(UTC)
        first = await client.post("/v1/chat/completions", json=_ask("chat", f"say {marker} now"))
        assert first.status_code == 200, first.text
        assert first.headers["x-capyctl-switch"].startswith("started chat")
        streamed = await client.post("/v1/chat/completions", json=_ask(
            "chat", marker, stream=True, stream_options={"include_usage": True}, max_tokens=5,
        ))  # fmt: skip
        assert streamed.status_code == 200
        assert streamed.text.rstrip().endswith("data: [DONE]")
        stopped = await client.post("/v1/chat/completions", json=_ask("off", marker))
        assert stopped.json()["error"]["code"] == "model_stopped"
        unknown = await client.post("/v1/chat/completions", json=_ask(marker, marker))
        assert unknown.status_code == 404
        client.headers["Authorization"] = "Bearer capy_nope_nope"
        bad_key = await client.post("/v1/chat/completions", json=_ask("chat", "hi"))
        assert bad_key.status_code == 401
    await gateway.close()  # what is not written yet is written now

    rows = await sync_to_async(_rows)()
    assert [(r["model"], r["stream"], r["status"], r["code"]) for r in rows] == [
        ("chat", False, 200, ""),
        ("chat", True, 200, ""),
        ("off", False, 503, "model_stopped"),
    ]
    served, stream, refused = rows
    assert {r["key_pk"] for r in rows} == {key_pk}
    assert started - timedelta(seconds=1) < served["at"] < stream["at"] < refused["at"]
    assert served["queued_ms"] == int(first.headers["x-capyctl-queued-ms"]) > 0
    assert served["switch"] == first.headers["x-capyctl-switch"]
    assert served["queued_ms"] <= served["ttfb_ms"] <= served["duration_ms"]
    assert (served["prompt_tokens"], served["completion_tokens"]) == (3, 8)
    assert (stream["queued_ms"], stream["switch"]) == (0, "")
    assert (stream["prompt_tokens"], stream["completion_tokens"]) == (1, 5)
    assert stream["ttfb_ms"] <= stream["duration_ms"]
    assert (refused["queued_ms"], refused["prompt_tokens"], refused["completion_tokens"]) == (
        0, 0, 0)  # fmt: skip
    assert refused["ttfb_ms"] is not None  # its error answer had a head

    exported = await sync_to_async(lambda: list(trace_lines()))()
    assert len(exported) == 3
    assert [list(json.loads(line)) for line in exported] == [list(FIELDS)] * 3
    assert json.loads(exported[2])["code"] == "model_stopped"
    assert json.loads(exported[0])["code"] is None
    assert all(marker not in str(row) for row in rows)
    assert all(marker not in line and "tok0" not in line for line in exported)


@pytest.mark.django_db(transaction=True)
async def test_a_client_that_leaves_while_queued_is_traced_as_499(gpu24, bob, database_threads):
    """Bob's request waits for chat's two-second start and he goes away after half a
    second: 499, as long queued as it waited, and no head (none was sent)."""

    def set_up() -> str:
        add_engine("slow", kind="vllm", command=f"{SIM} vllm",
                   env={**SIM_ENV, "CAPYCTL_SIM_LOAD_SECONDS": "2"})  # fmt: skip
        deployment("chat", engine="slow", gib=8)
        return issue_api_key("bob")[1]

    key = await sync_to_async(set_up)()
    body = [{"type": "http.request", "body": json.dumps(_ask("chat", "hi")).encode()}]

    async def receive() -> dict[str, Any]:
        if body:
            return body.pop()
        await asyncio.sleep(0.5)  # meanwhile it waits for the start
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    gateway = Gateway()
    await gateway({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                   "headers": headers, "query_string": b""}, receive, send)  # fmt: skip
    await gateway.close()
    assert sent == []
    [left] = await sync_to_async(_rows)()
    assert (left["model"], left["status"], left["code"], left["ttfb_ms"]) == ("chat", 499, "", None)
    assert 400 <= left["queued_ms"] <= left["duration_ms"] < 2000


@pytest.mark.django_db(transaction=True)
async def test_nothing_is_traced_when_tracing_is_off(gpu24, bob, database_threads, settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "TRACE": False}

    def set_up() -> str:
        vllm_engine()
        actions.ensure_ready(deployment("chat", gib=8).pk)
        return issue_api_key("bob")[1]

    key = await sync_to_async(set_up)()
    gateway = Gateway()
    async with _client(gateway, key) as client:
        answer = await client.post("/v1/chat/completions", json=_ask("chat", "hi"))
        assert answer.status_code == 200
    await gateway.close()
    assert await RequestTrace.objects.acount() == 0


@pytest.mark.django_db(transaction=True)
async def test_a_database_that_does_not_answer_keeps_the_batch(
    gpu24, bob, database_threads, monkeypatch, caplog
):
    """The first write of the traces fails (the database is locked): the batch is kept,
    and written with the next, a second later; said once, and once when it is back."""

    def set_up() -> str:
        vllm_engine()
        actions.ensure_ready(deployment("chat", gib=8).pk)
        return issue_api_key("bob")[1]

    key = await sync_to_async(set_up)()
    write = RequestTrace.objects.bulk_create
    tries: list[int] = []

    def locked_once(rows: list[RequestTrace]) -> list[RequestTrace]:
        tries.append(len(rows))
        if len(tries) == 1:
            raise OperationalError("database is locked")
        return write(rows)

    monkeypatch.setattr(RequestTrace.objects, "bulk_create", locked_once)
    gateway = Gateway()
    with caplog.at_level(logging.WARNING, logger="capyctl.gateway"):
        async with _client(gateway, key) as client:
            for _ in range(2):
                answer = await client.post("/v1/chat/completions", json=_ask("chat", "hi"))
                assert answer.status_code == 200
            deadline = time.monotonic() + 10
            while await RequestTrace.objects.acount() < 2:
                assert time.monotonic() < deadline, f"not written: {tries}"
                await asyncio.sleep(0.05)
    await gateway.close()
    assert tries == [2, 2]  # the same batch, tried again
    assert [r.getMessage() for r in caplog.records if r.name == "capyctl.gateway"] == [
        "traces not written (database is locked); kept in memory and tried again every second",
        "traces written again",
    ]


def test_the_book_keeps_the_newest_while_the_database_does_not_answer(caplog):
    """Past its limit the book drops the oldest traces, counts them, and says so once."""
    now = datetime.now(UTC)
    book = TraceBook(limit=3)
    for second in range(2):
        book.add(_trace(now + timedelta(seconds=second)))
    taken = book.take()
    assert not book.take()
    with caplog.at_level(logging.WARNING, logger="capyctl.gateway"):
        book.add(_trace(now + timedelta(seconds=2)))
        book.add(_trace(now + timedelta(seconds=3)))
        book.put_back(taken)  # the write failed: kept before the newer ones
        book.add(_trace(now + timedelta(seconds=4)))
    kept = [trace[0] - now.timestamp() for trace in book.take()]
    assert kept == pytest.approx([2, 3, 4])
    assert book.dropped == 2
    assert len(caplog.records) == 1
    assert "the oldest are dropped from now on" in caplog.records[0].getMessage()


def _statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements run, by their first word and table, less transaction control."""
    said = [q["sql"] for q in queries.captured_queries]
    return [" ".join(sql.replace('"', "").split()[:4]) for sql in said
            if sql not in ("BEGIN", "BEGIN IMMEDIATE", "COMMIT")]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_the_bound_prunes_the_oldest_rows_without_counting_them(settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "TRACE_MAX_ROWS": 5}
    writer = TraceWriter()
    now = datetime.now(UTC)
    seconds = iter(range(100))
    with CaptureQueriesContext(connection) as queries:
        for _ in range(3):
            writer([_trace(now + timedelta(seconds=next(seconds))) for _ in range(3)])
    assert RequestTrace.objects.count() == 5
    kept = [round((row.at - now).total_seconds()) for row in RequestTrace.objects.all()]
    assert kept == [4, 5, 6, 7, 8]  # the newest five
    assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries)
    assert [s for s in _statements(queries) if s.startswith("DELETE")] == [
        "DELETE FROM traces_requesttrace WHERE",
        "DELETE FROM traces_requesttrace WHERE",
    ]  # one statement a prune, no row read first

    settings.CAPYCTL = {**settings.CAPYCTL, "TRACE_MAX_ROWS": 1000}
    with CaptureQueriesContext(connection) as queries:  # within its bound: the INSERT alone
        writer([_trace(now + timedelta(seconds=next(seconds))) for _ in range(3)])
    assert _statements(queries) == ["INSERT INTO traces_requesttrace (at,"]
    assert RequestTrace.objects.count() == 8


@pytest.fixture
def recorded(db):
    """Traces of four requests, an hour apart, the last a minute ago."""
    now = datetime.now(UTC)
    rows = [
        RequestTrace(at=now - timedelta(minutes=1 + 60 * ago), model=model, key_pk=3,
                     stream=ago == 0, status=200 if model == "chat" else 504,
                     code="" if model == "chat" else "wake_timeout", queued_ms=812,
                     ttfb_ms=1040 if model == "chat" else None, duration_ms=2210,
                     prompt_tokens=12, completion_tokens=64,
                     switch="parked b (ram) 412 ms; woke a 688 ms" if ago == 3 else "")
        for ago, model in ((3, "chat"), (2, "code"), (1, "chat"), (0, "chat"))
    ]  # fmt: skip
    RequestTrace.objects.bulk_create(rows[::-1])  # written in another order: read by time
    return now


def test_the_export_is_json_lines_oldest_first(cli, recorded):
    result = cli("trace", "export")
    assert result.code == 0, result.err
    lines = [json.loads(line) for line in result.out.splitlines()]
    assert [list(line) for line in lines] == [list(FIELDS)] * 4
    assert [line["model"] for line in lines] == ["chat", "code", "chat", "chat"]
    assert all(AT.match(line["at"]) for line in lines)
    assert [line["at"] for line in lines] == sorted(line["at"] for line in lines)
    assert lines[0] == {
        "at": lines[0]["at"], "model": "chat", "key": 3, "stream": False, "status": 200,
        "code": None, "queued_ms": 812, "ttfb_ms": 1040, "duration_ms": 2210,
        "prompt_tokens": 12, "completion_tokens": 64,
        "switch": "parked b (ram) 412 ms; woke a 688 ms",
    }  # fmt: skip
    assert (lines[1]["code"], lines[1]["ttfb_ms"]) == ("wake_timeout", None)
    assert result.out.endswith("}\n")


def test_the_export_filters_by_time_and_model(cli, recorded):
    def models(*argv: str) -> list[str]:
        result = cli("trace", "export", *argv)
        assert result.code == 0, result.err
        return [json.loads(line)["model"] for line in result.out.splitlines()]

    assert models("--since", "90m") == ["chat", "chat"]
    assert models("--since", "3h", "--until", "30m") == ["code", "chat"]
    assert models("--model", "code") == ["code"]
    assert models("--model", "chat", "--since", "150m") == ["chat", "chat"]
    since = (recorded - timedelta(minutes=125)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert models("--since", since) == ["code", "chat", "chat"]
    naive = (recorded - timedelta(minutes=125)).strftime("%Y-%m-%dT%H:%M:%S")  # UTC
    assert models("--since", naive) == ["code", "chat", "chat"]
    assert models("--since", "7d", "--model", "ghost") == []


MOMENTS = "use a duration before now (24h, 30m, 7d) or an ISO time (2026-12-01T08:00Z)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--since", "yesterday"], f"invalid --since 'yesterday': {MOMENTS}"),
        (["--until", "2026-13-01"], f"invalid --until '2026-13-01': {MOMENTS}"),
        (
            ["--since", "0h"],
            "invalid --since '0h': use a number and a unit, like 30d, 12h, 45m or 2w",
        ),
        (["--since", "1h", "--until", "2h"], "--until '2h' is not after --since '1h'"),
    ],
)
def test_a_bad_time_is_one_line_and_exit_2(cli, argv, message):
    result = cli("trace", "export", *argv)
    assert (result.code, result.out) == (2, "")
    assert result.err == f"capyctl: error: {message}\n"


def test_staff_read_traces_in_the_admin_newest_first_and_cannot_change_them(
    client, alice, recorded
):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    page = client.get("/admin/traces/requesttrace/")
    assert page.status_code == 200
    text = page.content.decode()
    assert text.count("wake_timeout") == 1  # the one row that has it
    newest, oldest = RequestTrace.objects.order_by("-at")[0], RequestTrace.objects.all()[0]
    assert text.index(f"/{newest.pk}/change/") < text.index(f"/{oldest.pk}/change/")
    assert client.get("/admin/traces/requesttrace/add/").status_code == 403
    row = client.get(f"/admin/traces/requesttrace/{oldest.pk}/change/")
    assert row.status_code == 200
    assert "Save" not in row.content.decode()
    assert client.post(f"/admin/traces/requesttrace/{oldest.pk}/delete/").status_code == 403
