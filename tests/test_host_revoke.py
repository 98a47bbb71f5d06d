"""A host's certificate can be revoked: the server trusts an agent only with the very
certificate it joined with, checked after every handshake, so revoking (or re-joining)
makes the old certificate useless at once, though the CA signed it."""

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import uvloop

from capyctl.gateway.upstream import UpstreamError, UpstreamPool
from hostagent import tls
from tests.conftest import run_program
from tests.test_hosts_join import host_rows, joined, start_agent, wait_online

__all__ = ["joined"]  # the fixture, used by name below


def _events(env, kind):
    rows = json.loads(run_program(env, "events", "--json", "--limit", "200").out)
    return [e["message"] for e in rows if e["kind"] == kind]


@pytest.mark.e2e
def test_a_revoked_host_is_refused_at_once_and_joins_again_with_a_new_token(joined, tmp_path):
    env, _, agent_port, agent_dir, agent, base_url = joined
    run = lambda *argv: run_program(env, *argv)  # noqa: E731
    wait_online(env, "gpu1")
    assert run("engine", "add", "sim", "--kind", "vllm", "--command",
               f"{sys.executable} -m hostagent.sim vllm").code == 0  # fmt: skip
    assert run("deployment", "add", "r", "--engine", "sim", "--host", "gpu1", "--source",
               "m-r", "--gpu-memory", "20GiB").code == 0  # fmt: skip
    key = run("key", "create", "--user", "admin").out.strip()
    v1 = f"{base_url}/v1/chat/completions"
    ask = {"model": "r", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.post(v1, headers=headers, json=ask, timeout=60).status_code == 200
    assert run("cache", "list", "--host", "gpu1").code == 0  # a call from the CLI: trusted

    revoked = run("host", "revoke", "gpu1")
    assert revoked.code == 0, revoked.err
    assert "certificate revoked" in revoked.out
    assert revoked.err == ""  # what it did is said once: no log lines of its events
    row = host_rows(env)["gpu1"]
    assert (row["state"], row["joined"]) == ("unreachable", False)  # no trusted certificate

    # The next call to the agent, which still runs with its CA-signed certificate, fails
    # and says why in one line.
    refused = run("cache", "list", "--host", "gpu1")
    assert refused.code != 0
    assert "certificate revoked or does not match" in refused.err, refused.err
    assert "Traceback" not in refused.err
    # /v1 for its model is answered at once (routes are re-read within a second).
    deadline = time.monotonic() + 20
    while True:
        answer = httpx.post(v1, headers=headers, json=ask, timeout=60)
        if answer.status_code == 503:
            break
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.3)
    assert answer.json()["error"]["code"] == "host_unreachable"
    assert any("revoked" in m for m in _events(env, "host.revoked"))
    again = run("host", "revoke", "gpu1")
    assert again.code == 2
    assert "no certificate to revoke" in again.err

    # Joining again with a new token: a new certificate, trusted; the old one stays refused.
    token = run("host", "token", "gpu1").out.strip()
    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=15)
    rejoined = start_agent(env, tmp_path / "agent-new", agent_port, "--join", token)
    try:
        wait_online(env, "gpu1")
        assert host_rows(env)["gpu1"]["joined"] is True
        assert run("cache", "list", "--host", "gpu1").code == 0
        assert httpx.post(v1, headers=headers, json=ask, timeout=60).status_code == 200
    finally:
        rejoined.send_signal(signal.SIGTERM)
        rejoined.wait(timeout=15)
    old = tls.fingerprint((agent_dir / "agent.crt").read_bytes())
    new = tls.fingerprint((tmp_path / "agent-new" / "agent.crt").read_bytes())
    assert old != new


@pytest.mark.e2e
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_gateways_connections_check_the_pinned_certificate(joined, loop):
    """The /v1 relay connections (asyncio and uvloop transports) check the pin too."""
    env, _, agent_port, agent_dir, _, _ = joined
    pki = Path(env["CAPYCTL_DATA_DIR"]) / "pki"
    pinned = tls.fingerprint((agent_dir / "agent.crt").read_bytes())
    url = f"https://127.0.0.1:{agent_port}/inventory"

    async def inventory(pins):
        context = tls.client_context(
            pki / "ca.crt", pki / "server.crt", pki / "server.key", pins=pins
        )
        pool = UpstreamPool()
        try:
            answer = await pool.request("GET", url, ssl_context=context, server_hostname="gpu1")
            async with answer:
                return answer.status, await answer.read()
        finally:
            await pool.close()

    runner = uvloop.run if loop == "uvloop" else asyncio.run
    status, body = runner(inventory({"gpu1": pinned}))
    assert status == 200
    assert json.loads(body)["gpus"]
    for pins in ({"gpu1": "0" * 64}, {"gpu1": ""}, {}):
        with pytest.raises(UpstreamError, match=r"revoked|not the one it joined with"):
            runner(inventory(pins))


@pytest.mark.django_db
def test_revoke_over_rest_and_refusals(client, alice, settings, tmp_path):
    from capyctl.hosts.models import Host
    from capyctl.hosts.services import add_host, enrol

    settings.DATA_DIR = tmp_path
    _, token = add_host("gpu9", "10.0.0.9:7443")
    client.force_login(alice)
    refused = client.post("/api/hosts/gpu9/revoke/")
    assert refused.status_code == 400
    assert "no certificate to revoke" in refused.text
    enrol("gpu9", tls.JoinToken.decode(token).secret, tls.make_csr(tls.make_key(), "gpu9"))
    assert Host.objects.get(name="gpu9").cert_fingerprint
    done = client.post("/api/hosts/gpu9/revoke/")
    assert done.status_code == 200, done.text
    assert done.json()["state"] == "unreachable"
    row = Host.objects.get(name="gpu9")
    assert row.cert_fingerprint == ""
    assert row.join_secret_hmac == ""
    assert client.post("/api/hosts/ghost/revoke/").status_code == 404


@pytest.mark.django_db(transaction=True)
def test_a_poll_answered_while_the_host_was_revoked_leaves_it_unreachable(monkeypatch):
    """The periodic poll asked the agent, the host was revoked while the call was under
    way, then the poll wrote ``online`` from the agent's answer: a revoked host showed
    online (seen under load in the revoke test above)."""
    from django.utils import timezone

    from capyctl.hosts.models import Host
    from capyctl.scheduler import remote_hosts
    from capyctl.scheduler.host_states import revoke_host

    Host.objects.create(
        name="gpu9", address="127.0.0.1:7443", is_local=False, state=Host.State.ONLINE,
        enrolled_at=timezone.now(), cert_fingerprint="ab" * 32,
        inventory={"probe": "simulated", "ram_total_bytes": 2**34, "gpus": []},
    )  # fmt: skip

    def answered_while_revoked(host: Host, method: str, path: str) -> dict[str, object]:
        revoke_host(host.name)  # committed while the agent's answer was on its way
        return {"probe": "simulated", "ram_total_bytes": 2**34, "gpus": []}

    monkeypatch.setattr(remote_hosts, "agent_call", answered_while_revoked)
    remote_hosts.poll_hosts()
    assert Host.objects.get(name="gpu9").state == Host.State.UNREACHABLE
