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
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError
from django.db.backends import utils as db_utils

from capyctl.access import guessing
from capyctl.access.services import issue_api_key, set_user_limits
from capyctl.gateway import keys as gateway_keys
from capyctl.gateway.app import Gateway
from capyctl.gateway.cache import CHUNK
from capyctl.secret_hashing import hash_secret

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
    status, headers, _ = await ask(gateway, key, client)
    return status, headers


async def ask(
    gateway: Gateway, key: str, client: tuple[str, int]
) -> tuple[int, dict[bytes, bytes], dict[str, Any]]:
    """:func:`call`, with the error the answer names."""
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
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body) if body else {}


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
        # Afterwards only the real key is re-read (about four times a second), and it is
        # still the one key kept warm: its requests cost no read, as before the burst (how
        # long they take is bench/key_timing.py's to measure, not a test's on a busy machine).
        figures = f"p50 {before:.3f} ms before, {after:.3f} ms after; reads {burst_reads}"
        assert later_reads <= 20, figures
        cache = gateway.keys._infos
        assert list(cache._used_at) == [real.split("_")[1]]
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
            reads_before, flood_began = key_reads.count, time.monotonic()
            allowed = guessing.FAILURES_ALLOWED
            answers = [await call(gateway, guessed_key(), here) for _ in range(allowed)]
            # Then a flood, all at once: the throttled address's ids not in memory wait for
            # the slow lane, one shared read (a query per CHUNK ids) however many there are.
            flood = 2000 - allowed
            answers += await asyncio.gather(*(call(gateway, guessed_key(), here)
                                              for _ in range(flood)))  # fmt: skip
            # The flood's ids waited outside the warm set: no kept key gave way for them,
            # and the background re-reads never read them.
            assert list(gateway.keys._infos._used_at) == [real.split("_")[1]]
            # Meanwhile the warm real key is re-read in the background, every SOFT_TTL.
            rereads = int((time.monotonic() - flood_began) / gateway_keys.SOFT_TTL_SECONDS) + 2
            statuses = [status for status, _ in answers]
            assert statuses[:allowed] == [401] * allowed
            assert set(statuses[allowed + 1 :]) == {429}
            retry = int(answers[-1][1][b"retry-after"])
            # The header is the throttle's own wait, rounded up (not a constant): what is
            # left of it now is at most a second less than what the header said.
            left = gateway.keys.failures.wait(guessing.address_key(here[0]))
            assert left <= retry < left + 1.5, (retry, left)
            assert key_reads.count - reads_before <= allowed + -(-flood // CHUNK) + rereads
            # Retry-After is true: once it has passed, the address may fail once more (after
            # the read count: the warm real key is re-read while this waits).
            await asyncio.sleep(retry)
            assert (await call(gateway, guessed_key(), here))[0] == 401
            assert (await call(gateway, guessed_key(), here))[0] == 429
            # The real key, already in memory, still works from that address, and so does
            # one not yet in memory (read in the slow lane): the throttle slows guessing,
            # not use. Other addresses are not held back.
            assert (await call(gateway, real, here))[0] == 404
            assert (await call(gateway, unused, here))[0] == 404
            assert (await call(gateway, guessed_key(), ("192.0.2.8", 5555)))[0] == 401
            # IPv6 counts by /64: another address in the same /64 is the same client.
            v6 = [await call(gateway, guessed_key(), (f"2001:db8::{n:x}", 1))
                  for n in range(allowed + 1)]  # fmt: skip
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


async def models(
    gateway: Gateway,
    key: str,
    client: tuple[str, int],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, bytes]:
    """``GET /v1/models``: 200 and the list for a key that gets in."""
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/models",
        "raw_path": b"/v1/models",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode()), *(headers or [])],
        "client": client,
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gateway(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_a_real_key_idle_past_the_warm_cache_gets_in_from_a_throttled_address(bob, settings):
    """Behind a shared address, one client sending bad keys must not lock out another
    client's real key that has been idle long enough to leave the gateway's memory."""
    settings.CAPYCTL = {**settings.CAPYCTL, "KEY_KEEP_WARM_SECONDS": 0.3}
    key, real = issue_api_key("bob")
    here = ("192.0.2.70", 5555)

    async def scenario() -> None:
        gateway = Gateway()
        gateway.keys.failures.refill_seconds = 60  # no failure earned back during the test
        try:
            assert (await models(gateway, real, here))[0] == 200
            bad = [(await models(gateway, guessed_key(), here))[0] for _ in range(20)]
            bad += [status for status, _ in await asyncio.gather(
                *(models(gateway, guessed_key(), here) for _ in range(10)))]  # fmt: skip
            assert bad[-1] == 429  # the address is throttled
            wrong = f"{real[:-1]}{'A' if real[-1] != 'A' else 'B'}"
            assert (await models(gateway, wrong, here))[0] == 429  # a wrong secret is too
            await asyncio.sleep(1.5)  # the real key, unused, leaves the gateway's memory
            assert gateway.keys._infos.peek(key.key_id) == (False, None)
            assert gateway.keys.failures.wait(gateway_keys.client_address(here)) > 0
            status, body = await models(gateway, real, here)
            assert status == 200, body
            assert (await models(gateway, guessed_key(), here))[0] == 429  # still throttled
        finally:
            await gateway.close()

    asyncio.run(scenario())


def test_an_unknown_id_and_a_wrong_secret_are_refused_with_the_same_work(bob, monkeypatch):
    """Whether an id exists must not show in how the refusal is made: the unknown id's
    secret is hashed and compared too (with a stand-in), and a refusal answered from
    memory waits as long as a read takes."""
    key, real = issue_api_key("bob")
    wrong = f"{real[:-1]}{'A' if real[-1] != 'A' else 'B'}"
    unknown = guessed_key()
    hashed: list[str] = []

    def counted_hash(secret: str) -> str:
        hashed.append(secret)
        return hash_secret(secret)

    monkeypatch.setattr(gateway_keys, "hash_secret", counted_hash)

    async def scenario() -> None:
        gateway = Gateway()
        compared: list[str] = []
        matches = gateway.keys._matches

        def counted(info: gateway_keys.KeyInfo, secret: str) -> bool:
            compared.append(info.key_id)
            return matches(info, secret)

        gateway.keys._matches = counted  # type: ignore[method-assign]
        try:
            for n, presented in enumerate((real, wrong, unknown, unknown, wrong)):
                await call(gateway, presented, (f"198.51.100.{n}", 1))
            # Each well-formed key is compared once; the unknown id with a stand-in.
            assert compared == [key.key_id, key.key_id, "", "", key.key_id]
            assert len(hashed) == 5  # and each secret is hashed, an unknown id's too
            # Both refusals are answered from memory now (the unknown id is remembered as
            # missing, the real id is warm), and each waits as long as a read takes.
            gateway.keys._infos.read_seconds = 0.05
            for presented in (wrong, unknown):
                began = time.monotonic()
                assert (await call(gateway, presented, ("198.51.100.9", 1)))[0] == 401
                assert time.monotonic() - began >= 0.045
        finally:
            await gateway.close()

    asyncio.run(scenario())


def database_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every query fails as it does when PostgreSQL does not answer."""

    def refused(self: Any, sql: str, params: Any = None) -> Any:
        raise OperationalError("connection to server at 127.0.0.1, port 5432 failed")

    monkeypatch.setattr(db_utils.CursorWrapper, "execute", refused)
    monkeypatch.setattr(db_utils.CursorWrapper, "executemany", refused)


def test_a_key_that_expires_while_the_database_is_down_stops_working(bob, alice, monkeypatch):
    """While the database does not answer, the gateway serves the keys it read last; time
    still ends them: a key's own expiry, and its user's key lifetime (set after the key
    was made), are checked at each request."""
    expiring_key, expiring = issue_api_key("bob", expires_in=timedelta(seconds=6))
    lifetime_key, lifetime = issue_api_key("alice")
    set_user_limits("alice", key_lifetime=timedelta(seconds=6))
    assert expiring_key.expires_at is not None
    ends = max(expiring_key.expires_at, lifetime_key.created_at + timedelta(seconds=6))

    async def scenario() -> None:
        gateway = Gateway()
        try:
            for n, key in enumerate((expiring, lifetime)):
                assert (await call(gateway, key, (f"192.0.2.{n}", 1)))[0] == 404  # it works
            database_down(monkeypatch)
            await asyncio.sleep(gateway_keys.TTL_SECONDS + 0.2)  # what was read is stale
            for n, key in enumerate((expiring, lifetime)):
                status, _ = await call(gateway, key, (f"192.0.2.{n}", 1))
                if time.time() < ends.timestamp():  # (a loaded machine may be past it)
                    assert status == 404  # the last value read stands
            await asyncio.sleep(max(0.0, ends.timestamp() - time.time()) + 0.2)
            for n, key in enumerate((expiring, lifetime)):
                status, _, answer = await ask(gateway, key, (f"192.0.2.{n}", 1))
                assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        finally:
            await gateway.close()

    asyncio.run(scenario())
