"""Host registration, join tokens and enrolment, the local host's heartbeat and measures
(what changes a host's state is the scheduler's: :mod:`capyctl.scheduler.host_states`)."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from capyctl.errors import NotFoundError, UserError
from capyctl.events.services import record_event
from capyctl.hosts.models import LOCAL_HOST_NAME, Host
from capyctl.secret_hashing import hash_secret
from capyctl.validation import MAX_SIZE_BYTES, validate_name


def get_host(name: str) -> Host:
    try:
        return Host.objects.get(name=name)
    except Host.DoesNotExist:
        raise NotFoundError(f"no host named {name!r}", field="host") from None


def local_host_beat() -> None:
    """The process that drives the local host is alive, and so the host is seen: its
    heartbeat (whether a server runs, see ``server_alive``) and when it was last seen (what
    the dashboard and ``/api/hosts/`` show), together. Its state is not this function's:
    the scheduler's transitions write it."""
    now = timezone.now()
    Host.objects.filter(name=LOCAL_HOST_NAME).update(heartbeat_at=now, last_seen_at=now)


def note_measures(host: Host, inventory: dict[str, Any], *, store: bool = False) -> None:
    """Say, with an event, when ``inventory`` (the host's report now) measures engines' GPU
    memory otherwise than the report stored for ``host``. ``store``: write the new way into
    the stored report too (the local host's; a remote host's poll stores all of it)."""
    stored = host.inventory or {}
    way = str(inventory.get("measures") or "per process")
    reason = str(inventory.get("measures_reason") or "")
    if (stored.get("measures") or "per process") == way:
        return
    if store:
        updated = {**stored, "measures": way, "measures_reason": reason}
        Host.objects.filter(pk=host.pk).update(inventory=updated)
        host.inventory = updated
    if reason:  # the device path: per-process figures cannot be used here
        message = (
            f"host {host.name} measures GPU memory by {way} (each GPU's use before and "
            f"after every start, park and wake, one step at a time per GPU): {reason}"
        )
    else:
        message = f"host {host.name} measures GPU memory {way}"
    record_event("host.measures", message, subject=host.name, host_id=host.pk,
                 level="warning" if reason else "info")  # fmt: skip


# --- remote hosts: registration, join tokens, enrolment ------------------------------------


class EnrolError(Exception):
    """A refused enrolment; the message says why, in one line, for the agent to print."""


def parse_address(value: str, *, field: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) → (host, port), or a UserError naming it."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"invalid address {value!r}: use HOST:PORT", field=field)
    return host, int(port)


def add_host(name: str, address: str) -> tuple[Host, str]:
    """Register a remote host; returns it and its one-time join token."""
    validate_name(name, what="host name", field="name")
    if name == LOCAL_HOST_NAME:
        raise UserError(f"{LOCAL_HOST_NAME!r} is the in-process host's name", field="name")
    parse_address(address)
    with transaction.atomic():
        if Host.objects.filter(name=name).exists():
            raise UserError(f"a host named {name!r} already exists", field="name")
        host = Host.objects.create(name=name, address=address)  # its state: unknown
        token = new_join_token(host)
        record_event(
            "host.added",
            f"host {name} registered at {address}; waiting for it to join",
            subject=name,
            host_id=host.pk,
        )
    return host, token


def new_join_token(host: Host) -> str:
    """A fresh one-time token for ``host`` (any earlier one stops working)."""
    from capyctl.hosts.pki import pki  # noqa: PLC0415 - certificates (cryptography) kept off the listings' start-up
    from hostagent.tls import JoinToken  # noqa: PLC0415 - certificates (cryptography) kept off the listings' start-up

    secret = secrets.token_urlsafe(24)
    seconds = int(settings.CAPYCTL["JOIN_TOKEN_SECONDS"])
    Host.objects.filter(pk=host.pk).update(
        join_secret_hmac=hash_secret(secret),
        join_expires_at=timezone.now() + timedelta(seconds=seconds),
    )
    url = f"https://{settings.CAPYCTL['ENROL_ADDRESS']}"
    return JoinToken(url, pki().fingerprint(), host.name, secret).encode()


def enrol(host_name: str, secret: str, csr_pem: bytes) -> tuple[bytes, bytes]:
    """Spend a join token: sign the host's certificate request. Returns (certificate, CA
    certificate). A token works once, before it expires; a refused try changes nothing."""
    from cryptography import x509  # noqa: PLC0415 - certificates (cryptography) kept off the listings' start-up

    from capyctl.hosts.pki import pki, sign_request  # noqa: PLC0415 - certificates (cryptography) kept off the listings' start-up
    from hostagent import tls  # noqa: PLC0415 - certificates (cryptography) kept off the listings' start-up

    where = pki()
    now = timezone.now()
    with transaction.atomic():
        spent = Host.objects.filter(
            name=host_name, join_secret_hmac=hash_secret(secret), join_expires_at__gt=now
        ).update(join_secret_hmac="", join_expires_at=None)
        if spent != 1:
            # One answer for every reason, so a caller cannot learn which host names
            # exist; the log says which it was.
            raise _refused_token(host_name)
        try:
            cert = sign_request(where, csr_pem, host_name)
        except ValueError as exc:
            transaction.set_rollback(True)  # the token stays usable
            raise EnrolError(str(exc)) from None
        parsed = x509.load_pem_x509_certificate(cert)
        Host.objects.filter(name=host_name).update(
            enrolled_at=now,
            cert_fingerprint=tls.fingerprint(cert),
            cert_expires_at=parsed.not_valid_after_utc,
        )
        host = Host.objects.get(name=host_name)
        record_event(
            "host.enrolled",
            f"host {host_name} joined; its certificate is valid until "
            f"{parsed.not_valid_after_utc:%Y-%m-%d}",
            subject=host_name,
            host_id=host.pk,
        )
    return cert, where.ca_cert.read_bytes()


REFUSED_JOIN = (
    "this join token is not valid (unknown, already used, replaced or expired); "
    "make a new one on the server: capyctl host token NAME"
)


class RefusedTokenError(EnrolError):
    """A join token that does not open any enrolment; ``reason`` is for the log only."""

    def __init__(self, reason: str) -> None:
        super().__init__(REFUSED_JOIN)
        self.reason = reason


def _refused_token(host_name: str) -> RefusedTokenError:
    host = Host.objects.filter(name=host_name).first()
    if host is None:
        return RefusedTokenError("no such host")
    if not host.join_secret_hmac:
        return RefusedTokenError("no unused token (already used, or revoked)")
    if host.join_expires_at is not None and host.join_expires_at <= timezone.now():
        return RefusedTokenError("the token expired")
    return RefusedTokenError("not the host's current token")


@transaction.atomic
def update_host(
    name: str,
    *,
    address: str | None = None,
    reserves: dict[str, int | None] | None = None,
    actor: str = "",
) -> Host:
    """Change where a remote host's agent listens, or the memory it keeps free
    (``gpu_reserve_bytes``/``ram_reserve_bytes``; ``None`` means the global default)."""
    host = get_host(name)
    changed = []
    if address is not None:
        if host.is_local:
            raise UserError(f"{name!r} is the in-process host; it has no address", field="address")
        parse_address(address)
        host.address = address
        changed.append("address")
    for field_name, value in (reserves or {}).items():
        if value is not None and not 0 <= value <= MAX_SIZE_BYTES:
            raise UserError(f"{field_name} must be 0 to {MAX_SIZE_BYTES}", field=field_name)
        setattr(host, field_name, value)
        changed.append(field_name)
    host.save(update_fields=[*changed, "updated_at"])
    record_event(
        "host.changed",
        f"host {name} changed: {', '.join(changed) or 'nothing'}",
        subject=name,
        actor=actor,
        host_id=host.pk,
    )
    return host


def local_host() -> Host:
    """The in-process host, ``local`` (standalone's start registers it)."""
    return get_host(LOCAL_HOST_NAME)
