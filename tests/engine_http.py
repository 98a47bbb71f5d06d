"""Plain HTTP to a launched engine, as a test's own client: over its Unix socket where it
listens on one, else to its loopback port (no launch key unless the test sends one)."""

from __future__ import annotations

from typing import Any

import httpx

from hostagent.runtime import Instance


def engine_http(instance: Instance, **options: Any) -> httpx.Client:
    """A client whose relative URLs reach the instance's engine."""
    path = instance.socket_path
    transport = httpx.HTTPTransport(uds=str(path)) if path is not None else None
    return httpx.Client(base_url=instance.base_url, transport=transport, **options)


def listens_on(instance: Instance) -> set[str]:
    """What a local user would see of it: its TCP addresses' IPs (none on a socket)."""
    import psutil

    return {
        conn.laddr.ip
        for conn in psutil.Process(instance.pid).net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }
