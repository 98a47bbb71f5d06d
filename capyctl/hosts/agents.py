"""Calls from the server to host agents, over mutual TLS.

The server presents its own certificate (the only one the CA makes for client
authentication) and trusts an agent only if its certificate chains to the CA AND carries
the name the host was registered with: the TLS name check runs against the host's name,
not its address, so a valid certificate of another host is refused.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import httpx
from django.utils import timezone

from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.hosts.pki import pki
from hostagent import tls

logger = logging.getLogger("capyctl.hosts")
_clients: dict[str, httpx.Client] = {}
_clients_lock = threading.Lock()


class AgentUnreachableError(Exception):
    """The agent did not answer, or could not be trusted; the message says which."""


def _client() -> httpx.Client:
    where = pki()
    with _clients_lock:
        client = _clients.get(str(where.directory))
        if client is None:
            context = tls.client_context(where.ca_cert, where.server_cert, where.server_key)
            client = httpx.Client(
                verify=context, timeout=httpx.Timeout(10.0, connect=3.0), http2=False
            )
            _clients[str(where.directory)] = client
        return client


def agent_call(host: Host, method: str, path: str, **kwargs: Any) -> Any:
    """One JSON call to ``host``'s agent; its answer, or AgentUnreachableError."""
    try:
        answer = _client().request(
            method,
            f"https://{host.address}{path}",
            extensions={"sni_hostname": host.name},
            **kwargs,
        )
    except httpx.HTTPError as exc:
        raise AgentUnreachableError(f"host {host.name} ({host.address}): {exc}") from None
    if answer.status_code >= 400:
        raise AgentUnreachableError(
            f"host {host.name} answered {answer.status_code}: {answer.text[:200]}"
        )
    return answer.json()


def poll_hosts() -> None:
    """Ask every joined remote host for its inventory; mark it online or unreachable
    (with an event when that changes)."""
    for host in Host.objects.filter(is_local=False, enrolled_at__isnull=False):
        try:
            inventory = agent_call(host, "GET", "/inventory")
        except AgentUnreachableError as exc:
            if host.state != Host.State.UNREACHABLE:
                Host.objects.filter(pk=host.pk).update(state=Host.State.UNREACHABLE)
                record_event("host.unreachable", str(exc), subject=host.name, host_id=host.pk,
                             level="warning")  # fmt: skip
            continue
        Host.objects.filter(pk=host.pk).update(
            state=Host.State.ONLINE, inventory=inventory, last_seen_at=timezone.now()
        )
        if host.state != Host.State.ONLINE:
            gpus = ", ".join(g["name"] for g in inventory.get("gpus") or []) or "no GPUs"
            record_event("host.online", f"host {host.name} answers: {gpus}", subject=host.name,
                         host_id=host.pk)  # fmt: skip
