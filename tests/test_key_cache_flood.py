"""Guessed API keys cannot load the database or slow down the keys that are real.

The gateway's ASGI app is called in this process (50,000 requests over HTTP would test
the HTTP server, not the key cache), with the database reads it makes counted where
Django runs them."""

from __future__ import annotations

import asyncio
import json
import secrets
import statistics
import string
import threading
import time
from typing import Any

import pytest
from django.db.backends import utils as db_utils

from capyctl.access import guessing
from capyctl.access.services import issue_api_key
from capyctl.gateway import keys as gateway_keys
from capyctl.gateway.app import Gateway
from capyctl.gateway.cache import CHUNK

pytestmark = pytest.mark.django_db(transaction=True)

ALPHABET = string.ascii_lowercase + string.digits
BURST = 50_000


class KeyReads:
    """Counts the queries that read API keys, on every thread."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, sql: str) -> None:
        if 'FROM "access_apikey"' in sql:
            with self._lock:
                self.count += 1


@pytest.fixture
def key_reads(monkeypatch) -> KeyReads:
    reads = KeyReads()
    execute = db_utils.CursorWrapper.execute

    def counted(self: Any, sql: str, params: Any = None) -> Any:
        reads(sql)
        return execute(self, sql, params)

    monkeypatch.setattr(db_utils.CursorWrapper, "execute", counted)
    return reads


def guessed_key() -> str:
    key_id = "".join(secrets.choice(ALPHABET) for _ in range(10))
    return f"capy_{key_id}_{secrets.token_urlsafe(32)}"


async def call(
    gateway: Gateway, key: str, client: tuple[str, int]
) -> tuple[int, dict[bytes, bytes]]:
    """One ``POST /v1/chat/completions`` for a model no one has: a real key gets past the
    key check to a 404, without an engine; a guessed one stops at the check."""
    body = json.dumps({"model": "ghost", "messages": []}).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode()),
                    (b"content-type", b"application/json")],
        "client": client,
    }  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gateway(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"])


async def p50_ms(gateway: Gateway, key: str, seconds: float = 1.5) -> float:
    """The median time of a real key's request, sampled over a few re-reads of the cache."""
    timings = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began = time.perf_counter()
        status, _ = await call(gateway, key, ("10.0.0.1", 40000))
        timings.append((time.perf_counter() - began) * 1000)
        assert status == 404
        await asyncio.sleep(0.002)
    return statistics.median(timings)


def test_a_burst_of_guessed_ids_from_many_addresses(bob, key_reads):
    _, real = issue_api_key("bob")

    async def scenario() -> None:
        gateway = Gateway()
        try:
            for _ in range(50):
                await call(gateway, real, ("10.0.0.1", 40000))
            before = await p50_ms(gateway, real)
            reads_before = key_reads.count
            guesses = [guessed_key() for _ in range(BURST)]
            # Each guess from an address of its own: the per-address throttle cannot help.
            answers = await asyncio.gather(*(
                call(gateway, guess, (f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}", 1))
                for n, guess in enumerate(guesses)
            ))  # fmt: skip
            assert {status for status, _ in answers} == {401}
            burst_reads = key_reads.count - reads_before
            after = await p50_ms(gateway, real)
            later_reads = key_reads.count - reads_before - burst_reads
        finally:
            await gateway.close()
        # Lookups that arrive together share a query of at most CHUNK ids (and the real
        # key is re-read a few times a second meanwhile).
        assert burst_reads <= BURST // CHUNK + 40
        # Afterwards only the real key is re-read (about four times a second).
        assert later_reads <= 20
        figures = f"p50 {before:.3f} ms before, {after:.3f} ms after; reads {burst_reads}"
        assert after <= 2 * before, figures
        cache = gateway.keys._infos
        assert len(cache._used_at) == 1
        assert len(cache._missing) <= gateway_keys.KEYS_KEPT
        assert len(gateway.keys.failures) <= guessing.ADDRESSES_KEPT

    asyncio.run(scenario())


def test_an_address_that_keeps_failing_is_slowed_but_its_real_key_works(bob, key_reads):
    _, real = issue_api_key("bob")
    _, unused = issue_api_key("bob")
    here = ("192.0.2.7", 5555)

    async def scenario() -> None:
        gateway = Gateway()
        try:
            assert (await call(gateway, real, here))[0] == 404  # in memory from now on
            reads_before = key_reads.count
            answers = [await call(gateway, guessed_key(), here) for _ in range(2000)]
            statuses = [status for status, _ in answers]
            allowed = guessing.FAILURES_ALLOWED
            assert statuses[:allowed] == [401] * allowed
            assert set(statuses[allowed + 1 :]) == {429}
            retry = int(answers[-1][1][b"retry-after"])
            # The header is the throttle's own wait, rounded up (not a constant): what is
            # left of it now is at most a second less than what the header said.
            left = gateway.keys.failures.wait(guessing.address_key(here[0]))
            assert left <= retry < left + 1.5, (retry, left)
            assert key_reads.count - reads_before <= allowed + 2
            # Retry-After is true: once it has passed, the address may fail once more (after
            # the read count: the warm real key is re-read while this waits).
            await asyncio.sleep(retry)
            assert (await call(gateway, guessed_key(), here))[0] == 401
            assert (await call(gateway, guessed_key(), here))[0] == 429
            # The real key, already in memory, still works from that address...
            assert (await call(gateway, real, here))[0] == 404
            # ...a real key not yet in memory waits like a guess, and other addresses
            # are not held back.
            assert (await call(gateway, unused, here))[0] == 429
            assert (await call(gateway, unused, ("192.0.2.8", 5555)))[0] == 404
            # IPv6 counts by /64: another address in the same /64 is the same client.
            v6 = [await call(gateway, guessed_key(), (f"2001:db8::{n:x}", 1)) for n in range(50)]
            assert v6[-1][0] == 429
            assert (await call(gateway, guessed_key(), ("2001:db8:0:1::1", 1)))[0] == 401
        finally:
            await gateway.close()

    asyncio.run(scenario())


def test_keys_of_the_wrong_shape_are_refused_before_any_lookup(bob, key_reads):
    key, real = issue_api_key("bob")
    secret = real.split("_", 2)[2]
    wrong = [
        f"capy_{key.key_id.upper()}_{secret}",  # the id's alphabet
        f"capy_{key.key_id}x_{secret}",  # its length
        f"capy_{key.key_id}_{secret}x",  # the secret's length
        f"capy_{key.key_id}_{secret[:-1]}!",  # its alphabet
        f"capy_{key.key_id}_{secret[:-1]}\u00e9",
        "capy_nope_nope",
        "",
    ]

    key_reads.count = 0  # issuing the key looked for a clash

    async def scenario() -> None:
        gateway = Gateway()
        try:
            for n, presented in enumerate(wrong):
                assert (await call(gateway, presented, (f"198.51.100.{n}", 1)))[0] == 401
            assert key_reads.count == 0
            assert (await call(gateway, real, ("198.51.100.99", 1)))[0] == 404
            assert key_reads.count == 1
        finally:
            await gateway.close()

    asyncio.run(scenario())
