"""Whatever fails inside the gateway, the client gets an OpenAI-shaped error, never a bare
500: an exception is planted at each step of a request (the key check, the limits, the
route lookup, the in-flight count, the engine call), as Redis or the database failing
there would raise it."""

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from typing import Any, cast

import httpx
import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import OperationalError, connection

from capyctl.access.models import ApiKey
from capyctl.access.services import issue_api_key
from capyctl.gateway.app import Gateway
from capyctl.scheduler import actions, requests_in_progress
from tests.conftest import table_counts
from tests.scheduling import deployment, state, vllm_engine

REDIS_DOWN = redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379.")


def _raising(exc: Exception) -> Any:
    async def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


def _plant(gateway: Gateway, step: str, exc: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    if step == "key check":
        monkeypatch.setattr(gateway.keys, "check", _raising(exc))
    elif step == "limits":
        monkeypatch.setattr(gateway.limits, "admit", _raising(exc))
    elif step == "route":
        monkeypatch.setattr(gateway.routes, "get", _raising(exc))
    elif step == "in flight":
        monkeypatch.setattr(requests_in_progress, "abegin", _raising(exc))
    else:  # the engine call
        pool = gateway.forwarding.client()
        monkeypatch.setattr(pool, "request", _raising(exc))


STEPS = ["key check", "limits", "route", "in flight", "engine call"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(
    "failure",
    [
        (REDIS_DOWN, 503, "control_plane_unavailable"),
        (OperationalError("could not connect to server"), 503, "control_plane_unavailable"),
        (RuntimeError("a bug"), 500, "internal_error"),
    ],
    ids=["redis", "database", "bug"],
)
async def test_a_failure_at_any_step_is_an_openai_error(  # noqa: PLR0917 - fixtures
    gpu24, bob, step, failure, monkeypatch, caplog
):
    exc, status, code = failure

    def set_up() -> str:
        vllm_engine()
        actions.ensure_ready(deployment("chat").pk)
        return issue_api_key("bob")[1]

    key = await sync_to_async(set_up)()
    gateway = Gateway()
    _plant(gateway, step, exc, monkeypatch)
    transport = httpx.ASGITransport(app=cast("Any", gateway))
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level(logging.ERROR, logger="capyctl.gateway"):
        async with httpx.AsyncClient(
            transport=transport, base_url="http://testserver",
            headers={"Authorization": f"Bearer {key}"},
        ) as client:  # fmt: skip
            answer = await client.post("/v1/chat/completions", json=body)
    await gateway.close()
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == code
    assert error["type"] == "server_error"
    assert ("retry-after" in answer.headers) == (status == 503)
    logged = [r for r in caplog.records if r.name == "capyctl.gateway" and r.exc_info]
    assert len(logged) == 1  # once, with its cause
    assert logged[0].exc_info is not None
    assert logged[0].exc_info[1] is exc


@contextlib.contextmanager
def locked_by_another_program(wait_seconds: float) -> Iterator[None]:
    """SQLite's write lock held by another program (a person's ``sqlite3`` shell in the
    middle of a write, a backup), while CapyCTL waits ``wait_seconds`` for a lock (its
    default: 20 s), so a test need not wait that long."""
    options = connection.settings_dict["OPTIONS"]  # every thread's connection reads these
    saved = options["timeout"]
    options["timeout"] = wait_seconds  # from each thread's next connection
    holder = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.rollback()
        holder.close()
        options["timeout"] = saved


@pytest.mark.django_db(transaction=True)
async def test_a_database_locked_by_another_program(gpu24, bob):
    """Standalone's SQLite locked by another program for longer than CapyCTL waits: the
    ready model keeps answering; a request that needs a start gets 503
    control_plane_unavailable saying the database is locked (Retry-After 1) and nothing is
    half-written; once the lock is gone, the same request is served."""

    def set_up() -> str:
        vllm_engine()
        actions.ensure_ready(deployment("chat", gib=8).pk)
        deployment("other", gib=8)
        return issue_api_key("bob")[1]

    key = await sync_to_async(set_up)()
    gateway = Gateway()
    transport = httpx.ASGITransport(app=cast("Any", gateway))

    def ask(model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}]}

    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver",
        headers={"Authorization": f"Bearer {key}"},
    ) as client:  # fmt: skip
        assert (await client.post("/v1/chat/completions", json=ask("chat"))).status_code == 200
        before = await sync_to_async(table_counts)()
        with locked_by_another_program(0.5):
            for _ in range(3):
                ready = await client.post("/v1/chat/completions", json=ask("chat"))
                assert ready.status_code == 200, ready.text
            refused = await client.post("/v1/chat/completions", json=ask("other"))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "control_plane_unavailable"
            assert refused.json()["error"]["message"] == (
                "CapyCTL's database is locked by another program; retry shortly."
            )
            assert refused.headers["retry-after"] == "1"
        assert await sync_to_async(table_counts)() == before  # nothing half-written
        assert await sync_to_async(state)("other") == ("stopped", "")
        served = await client.post("/v1/chat/completions", json=ask("other"))
        assert served.status_code == 200, served.text

        def counted() -> int:
            return ApiKey.objects.get(user__username="bob").request_count

        for _ in range(100):  # the requests served under the lock are written once it goes
            if await sync_to_async(counted)() == 5:
                break
            await asyncio.sleep(0.1)
        assert await sync_to_async(counted)() == 5
    await gateway.close()


@pytest.mark.django_db(transaction=True)
def test_the_cli_says_the_database_is_locked(cli, data_dir):
    """A command that must write while another program holds the lock: one line naming the
    database and what to do, exit 1, nothing changed."""
    assert cli("engine", "add", "sim", "--kind", "vllm", "--command", "sim-engine").code == 0
    before = table_counts()
    with locked_by_another_program(0.5):
        connection.close()  # this thread's next connection waits as briefly
        added = cli("deployment", "add", "a", "--engine", "sim", "--source", "a",
                    "--gpu-memory", "8GiB")  # fmt: skip
        listed = cli("engine", "list")  # reading needs no lock
    assert (added.code, added.out) == (1, "")
    assert added.err == (
        f"capyctl: error: the database ({connection.settings_dict['NAME']}) is locked by "
        "another program (waited for 0.5s): nothing was changed; retry when it is done\n"
    )
    assert listed.code == 0
    assert "sim" in listed.out
    connection.close()
    assert table_counts() == before
