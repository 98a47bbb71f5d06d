"""The enrolment listener: where a new host spends its join token for a certificate.

A small ASGI app served over TLS with the server's certificate (no client certificate:
the host has none yet). ``GET /ca`` gives the CA certificate, which the host checks
against the fingerprint in its token before trusting anything else; ``POST /enrol`` takes
``{"host", "secret", "csr"}`` and answers ``{"certificate", "ca"}`` or ``{"error"}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from capyctl.hosts.pki import pki
from capyctl.hosts.services import EnrolError, enrol
from hostagent.asgi import lifespan, send_bytes, send_json

logger = logging.getLogger("capyctl.hosts")
_MAX_BODY = 64 * 1024


async def enrol_application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    method, path = scope["method"], scope["path"]
    if method == "GET" and path == "/ca":
        ca = await sync_to_async(_ca_pem, thread_sensitive=False)()
        await send_bytes(send, 200, ca, b"application/x-pem-file")
    elif method == "POST" and path == "/enrol":
        await _enrol_request(receive, send)
    else:
        await send_json(send, 404, {"error": f"no such route: {method} {path}"})


def _ca_pem() -> bytes:
    return pki().ca_cert.read_bytes()


async def _enrol_request(receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > _MAX_BODY:
            await send_json(send, 413, {"error": "the request is too large"})
            return
        if not message.get("more_body"):
            break
    try:
        data = json.loads(body)
        host, secret, csr = str(data["host"]), str(data["secret"]), str(data["csr"])
    except (ValueError, KeyError, TypeError):
        await send_json(send, 400, {"error": "send JSON with host, secret and csr"})
        return
    try:
        cert, ca = await sync_to_async(_enrol, thread_sensitive=False)(host, secret, csr)
    except EnrolError as exc:
        reason = getattr(exc, "reason", str(exc))  # the log says why; the answer does not
        logger.warning("refused an enrolment for host %r: %s", host[:80], reason)
        await send_json(send, 403, {"error": str(exc)})
        return
    await send_json(send, 200, {"certificate": cert.decode(), "ca": ca.decode()})


def _enrol(host: str, secret: str, csr: str) -> tuple[bytes, bytes]:
    close_old_connections()
    try:
        return enrol(host, secret, csr.encode())
    finally:
        close_old_connections()
