"""The remote host driver and host polling: calls from the server to host agents, over
mutual TLS.

The server presents its own certificate (the only one the CA makes for client
authentication) and trusts an agent only if its certificate chains to the CA, carries the
name the host was registered with (the TLS name check runs against the host's name, not
its address, so a valid certificate of another host is refused) AND is the very
certificate the host joined with: its SHA-256 is compared with the host row's after every
handshake. Revoking or re-joining a host changes that row, so the old certificate is
refused from the next call on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from typing import Any

import httpx

from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.hosts.pki import pki
from capyctl.hosts.services import note_measures
from capyctl.scheduler import transitions
from hostagent import tls, wire
from hostagent.errors import EngineCallError
from hostagent.host import Launched
from hostagent.probe import DeviceReading, Inventory, ProcessUsage
from hostagent.runtime import InstanceRequest
from hostagent.sources import FetchStatus

logger = logging.getLogger("capyctl.hosts")
_clients: dict[tuple[str, str], tuple[str, httpx.Client]] = {}
_clients_lock = threading.Lock()


class AgentUnreachableError(EngineCallError):
    """The agent did not answer, or could not be trusted; the message says which. To the
    scheduler it is a failed engine call: what it cannot confirm stays counted."""


def _client(host: Host) -> httpx.Client:
    """A client (a connection pool) for ``host`` that trusts only the certificate pinned
    in its row now: one primary-key read a call, so a revocation counts at once. When the
    pin changes, the old pool and its open connections are closed."""
    pin = Host.objects.filter(pk=host.pk).values_list("cert_fingerprint", flat=True).first()
    pin = pin or ""
    where = pki()
    slot = (str(where.directory), host.name)
    with _clients_lock:
        found = _clients.get(slot)
        if found is not None and found[0] == pin:
            return found[1]
        if found is not None:
            found[1].close()
        context = tls.client_context(
            where.ca_cert, where.server_cert, where.server_key, pins={host.name: pin}
        )
        client = httpx.Client(verify=context, timeout=httpx.Timeout(10.0, connect=3.0))
        _clients[slot] = (pin, client)
        return client


def _refusal(host: Host, exc: httpx.HTTPError) -> str:
    """Why a call failed, in one line; a pin mismatch says so plainly."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, tls.PinMismatchError):
            return f"certificate revoked or does not match: {cause}"
        cause = cause.__cause__ or cause.__context__
    return str(exc)


def agent_call(host: Host, method: str, path: str, **kwargs: Any) -> Any:
    """One JSON call to ``host``'s agent; its answer, or AgentUnreachableError."""
    try:
        answer = _client(host).request(
            method,
            f"https://{host.address}{path}",
            extensions={"sni_hostname": host.name},
            **kwargs,
        )
    except httpx.HTTPError as exc:
        raise AgentUnreachableError(
            f"host {host.name} ({host.address}): {_refusal(host, exc)}"
        ) from None
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
            mark_unreachable(host, str(exc))
            continue
        # Online only if it still holds the certificate this call trusted: a revoke that
        # landed while the call was under way is not undone by its answer. If it was
        # unreachable, its entries count as held again; reconcile then finds out which
        # engines are still there (and fails the ones that are gone).
        was = transitions.host_answers(host, inventory, pin=host.cert_fingerprint)
        if was is None:
            continue
        note_measures(host, inventory)
        if was != Host.State.ONLINE:
            gpus = ", ".join(g["name"] for g in inventory.get("gpus") or []) or "no GPUs"
            record_event("host.online", f"host {host.name} answers: {gpus}", subject=host.name,
                         host_id=host.pk)  # fmt: skip


def mark_unreachable(host: Host, reason: str) -> None:
    """Say ``host`` is unreachable (an event when that is news); what its models hold stays
    counted, as memory nobody can confirm now."""
    if host.state == Host.State.UNREACHABLE or not transitions.host_unreachable(host):
        return
    record_event("host.unreachable", reason, subject=host.name, host_id=host.pk,
                 level="warning")  # fmt: skip


class RemoteHostDriver:
    """A remote host's engines, through its agent: the same calls as the local driver,
    as JSON over mutual TLS. Engine errors come back as the same error classes."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def _call(self, method: str, path: str, *, timeout: float = 10.0, **kwargs: Any) -> Any:
        try:
            answer = _client(self.host).request(
                method,
                f"https://{self.host.address}{path}",
                extensions={"sni_hostname": self.host.name},
                timeout=httpx.Timeout(timeout, connect=3.0),
                **kwargs,
            )
        except httpx.HTTPError as exc:
            raise AgentUnreachableError(
                f"host {self.host.name} ({self.host.address}) did not answer: "
                f"{_refusal(self.host, exc)}"
            ) from None
        if answer.status_code == 409:
            raise wire.error_from_json(answer.json()["error"])
        if answer.status_code >= 400:
            raise AgentUnreachableError(
                f"host {self.host.name} refused {method} {path}: {answer.text[:200]}"
            )
        return answer.json()

    def inventory(self) -> Inventory:
        return Inventory.from_dict(self._call("GET", "/inventory"))

    def devices(self) -> list[DeviceReading]:
        return [DeviceReading(**d) for d in self._call("GET", "/devices")["devices"]]

    def launch(self, request: InstanceRequest) -> Launched:
        return Launched(**self._call("POST", "/instances", json=asdict(request), timeout=60))

    def wait_ready(self, instance_id: str, timeout: float) -> float:
        body = {"timeout": timeout}
        path = f"/instances/{instance_id}/wait_ready"
        return float(self._call("POST", path, json=body, timeout=timeout + 30)["seconds"])

    def park(self, instance_id: str, mode: str, timeout: float) -> ProcessUsage:
        body = {"mode": mode, "timeout": timeout}
        path = f"/instances/{instance_id}/park"
        return wire.usage_from_json(self._call("POST", path, json=body, timeout=timeout + 60))

    def wake(self, instance_id: str, mode: str, timeout: float) -> float:
        body = {"mode": mode, "timeout": timeout}
        path = f"/instances/{instance_id}/wake"
        return float(self._call("POST", path, json=body, timeout=timeout + 30)["seconds"])

    def load_adapter(self, instance_id: str, name: str, source: str, timeout: float) -> float:
        body = {"name": name, "source": source, "timeout": timeout}
        path = f"/instances/{instance_id}/adapters/load"
        return float(self._call("POST", path, json=body, timeout=timeout + 30)["seconds"])

    def unload_adapter(self, instance_id: str, name: str) -> None:
        path = f"/instances/{instance_id}/adapters/unload"
        self._call("POST", path, json={"name": name}, timeout=90)

    def loaded_adapters(self, instance_id: str) -> list[str] | None:
        loaded = self._call("GET", f"/instances/{instance_id}/adapters", timeout=60)["loaded"]
        return None if loaded is None else [str(name) for name in loaded]

    def stop(self, instance_id: str, grace_seconds: float) -> int:
        body = {"grace_seconds": grace_seconds}
        path = f"/instances/{instance_id}/stop"
        return int(
            self._call("POST", path, json=body, timeout=grace_seconds + 30)["exit_code"] or 0
        )

    def usage(self, instance_id: str) -> ProcessUsage:
        return wire.usage_from_json(self._call("GET", f"/instances/{instance_id}/usage"))

    def asleep(self, instance_id: str) -> bool | None:
        answer = self._call("GET", f"/instances/{instance_id}/asleep").get("asleep")
        return None if answer is None else bool(answer)

    def fetch_start(self, source: str) -> FetchStatus:
        return FetchStatus.from_dict(self._call("POST", "/sources/fetch", json={"source": source}))

    def fetch_status(self, source: str) -> FetchStatus | None:
        found = self._call("POST", "/sources/status", json={"source": source})["status"]
        return FetchStatus.from_dict(found) if found is not None else None

    def downloads(self) -> list[dict[str, object]]:
        return list(self._call("GET", "/sources", timeout=120)["downloads"])

    def prune(self, keep: list[str], dry_run: bool) -> list[dict[str, object]]:
        body = {"keep": keep, "dry_run": dry_run}
        return list(self._call("POST", "/sources/prune", json=body, timeout=600)["removed"])

    def _report(self, instance_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/instances/{instance_id}"))

    def alive(self, instance_id: str) -> bool:
        return bool(self._report(instance_id)["alive"])

    def known(self, instance_id: str) -> bool:
        return bool(self._report(instance_id)["known"])

    def exit_report(self, instance_id: str) -> tuple[int | None, str]:
        report = self._report(instance_id)
        return report["exit_code"], str(report["log_tail"])

    def instance_ids(self) -> list[str]:
        return [str(i) for i in self._call("GET", "/instances")["ids"]]

    def foreign(self, unified: bool) -> dict[str, int]:
        figures = self._call("GET", f"/foreign?unified={int(unified)}")
        return {str(k): int(v) for k, v in figures.items()}
