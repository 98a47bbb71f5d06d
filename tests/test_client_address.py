"""Who the client is, behind a proxy: the throttles count each client's own address.

Behind a TLS proxy every connection comes from the proxy. With ``CAPYCTL_TRUSTED_PROXIES``
naming it, CapyCTL reads the proxy's ``X-Forwarded-For`` (the rightmost hop that is not a
trusted proxy is the client), so one client's bad keys or failed logins hold back only
that client; from anyone else the header is ignored, so a client cannot choose the address
it is counted by."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from django.core.cache import cache
from django.test import Client

from capyctl.access.guessing import client_ip
from capyctl.access.services import issue_api_key
from capyctl.conf import ConfigError, env_networks
from capyctl.gateway.app import Gateway
from tests.test_key_cache_flood import guessed_key, models

PROXY = "10.0.0.2"
PROXIES = (ipaddress.ip_network("10.0.0.0/29"), ipaddress.ip_network("fd00::/64"))


@pytest.fixture
def behind_proxy(settings) -> None:
    settings.CAPYCTL = {**settings.CAPYCTL, "TRUSTED_PROXIES": PROXIES}


def test_only_a_trusted_proxys_forwarded_for_is_believed():
    cases = [
        # (who connected, X-Forwarded-For, the client as counted)
        ("198.51.100.7", "203.0.113.1", "198.51.100.7"),  # not a proxy: its header is ignored
        (PROXY, None, PROXY),
        (PROXY, "203.0.113.1", "203.0.113.1"),
        # What the client wrote itself is left of what the proxy appended: never reached.
        (PROXY, "1.1.1.1, 203.0.113.1", "203.0.113.1"),
        (PROXY, "203.0.113.1, 10.0.0.3", "203.0.113.1"),  # two trusted proxies in a row
        (PROXY, "10.0.0.4, 10.0.0.3", "10.0.0.4"),  # all trusted: the leftmost
        (PROXY, "1.1.1.1, not-an-address", PROXY),  # no address: the last trusted hop
        (PROXY, "1.1.1.1, 203.0.113.1:4000", PROXY),
        (PROXY, "[2001:db8::1]", "2001:db8::1"),
        ("::ffff:10.0.0.2", "203.0.113.1", "203.0.113.1"),  # IPv4 mapped into IPv6
        ("fd00::5", "2001:db8::9", "2001:db8::9"),
        ("fd00:0:0:1::5", "2001:db8::9", "fd00:0:0:1::5"),  # outside the trusted /64
        ("", "203.0.113.1", ""),
    ]
    assert [client_ip(peer, forwarded, PROXIES) for peer, forwarded, _ in cases] == [
        client for _, _, client in cases
    ]
    assert client_ip(PROXY, "203.0.113.1", ()) == PROXY  # none trusted: none believed


def test_trusted_proxies_are_read_from_the_environment():
    assert env_networks("CAPYCTL_TRUSTED_PROXIES", {}) == ()
    assert env_networks(
        "CAPYCTL_TRUSTED_PROXIES", {"CAPYCTL_TRUSTED_PROXIES": "10.0.0.2, fd00::/64"}
    ) == (
        ipaddress.ip_network("10.0.0.2/32"),
        ipaddress.ip_network("fd00::/64"),
    )
    with pytest.raises(ConfigError) as refused:
        env_networks("CAPYCTL_TRUSTED_PROXIES", {"CAPYCTL_TRUSTED_PROXIES": "10.0.0.2, proxy.lan"})
    assert str(refused.value) == "CAPYCTL_TRUSTED_PROXIES: 'proxy.lan' is not an address or network"


def via(address: str) -> Client:
    """A browser at ``address``, behind the proxy."""
    return Client(REMOTE_ADDR=PROXY, HTTP_X_FORWARDED_FOR=address)


@pytest.mark.django_db
def test_a_login_lockout_behind_a_trusted_proxy_holds_back_only_the_failing_address(
    alice, settings, behind_proxy
):
    settings.LOGIN_MAX_FAILURES = 3
    cache.clear()
    wrong = {"username": "alice", "password": "guess-guess"}
    right = {"username": "alice", "password": "alice-password-1"}
    a, b = via("203.0.113.1"), via("203.0.113.2")
    assert [a.post("/login/", wrong).status_code for _ in range(3)] == [200, 200, 429]
    assert b.post("/login/", right).status_code == 302  # another address: never locked
    assert a.post("/login/", right).status_code == 429  # the failing one still is
    # The same /64 of IPv6 is one client; another /64 is another.
    c, d = via("2001:db8::1"), via("2001:db8:0:1::1")
    assert [c.post("/login/", wrong).status_code for _ in range(3)] == [200, 200, 429]
    assert via("2001:db8::2").post("/login/", right).status_code == 429
    assert d.post("/login/", right).status_code == 302


@pytest.mark.django_db
def test_a_client_that_is_no_trusted_proxy_cannot_choose_its_address(alice, settings, behind_proxy):
    settings.LOGIN_MAX_FAILURES = 3
    cache.clear()
    wrong = {"username": "alice", "password": "guess-guess"}
    statuses = [
        Client(REMOTE_ADDR="198.51.100.7", HTTP_X_FORWARDED_FOR=f"203.0.113.{n}")
        .post("/login/", wrong)
        .status_code
        for n in range(4)
    ]
    assert statuses == [200, 200, 429, 429]


@pytest.mark.django_db(transaction=True)
def test_the_key_throttles_behind_a_trusted_proxy_count_each_client(alice, behind_proxy):
    """One client behind the proxy guessing keys is throttled; the proxy's other clients
    are not, on /v1 and on REST."""
    _, real = issue_api_key("alice", admin=True)

    async def gateway_side() -> None:
        gateway = Gateway()

        async def through_proxy(key: str, client: str) -> int:
            forwarded = [(b"x-forwarded-for", f"1.1.1.1, {client}".encode())]
            status, _ = await models(gateway, key, (PROXY, 1), forwarded)
            return status

        try:
            guessing = [await through_proxy(guessed_key(), "203.0.113.1") for _ in range(21)]
            assert guessing[-1] == 429
            assert await through_proxy(guessed_key(), "203.0.113.2") == 401  # not throttled
            assert await through_proxy(real, "203.0.113.2") == 200
        finally:
            await gateway.close()

    asyncio.run(gateway_side())

    from capyctl.api import auth

    auth.reset_guards()
    try:
        bad = [
            via("203.0.113.1")
            .get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}")
            .status_code
            for _ in range(21)
        ]
        assert bad[-1] == 429
        other = via("203.0.113.2").get(
            "/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {guessed_key()}"
        )
        assert other.status_code == 401
    finally:
        auth.reset_guards()
