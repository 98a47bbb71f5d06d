"""Whatever fails inside the gateway, the client gets an OpenAI-shaped error, never a bare
500: an exception is planted at each step of a request (the key check, the limits, the
route lookup, the in-flight count, the engine call), as Redis or the database failing
there would raise it."""

import logging
from typing import Any, cast

import httpx
import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import OperationalError

from capyctl.access.services import issue_api_key
from capyctl.gateway.app import Gateway
from capyctl.scheduler import inflight, operations
from tests.scheduling import deployment, vllm_engine

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
        monkeypatch.setattr(inflight, "abegin", _raising(exc))
    else:  # the engine call
        pool = gateway._client()
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
        operations.ensure_ready(deployment("chat").pk)
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
