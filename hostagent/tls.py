"""Keys, certificate requests and TLS contexts for mutual TLS between server and hosts.

The server keeps a private CA and signs each host's certificate (the host's name in its
SAN, for server authentication only); the server's own certificate is the only one made
for client authentication, so an agent that requires a client certificate from the CA
accepts the server and no other host. Both sides use TLS 1.2 or newer.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PrivateKey = ec.EllipticCurvePrivateKey
SERVER_NAME = "capyctl-server"  # the name in the server's certificate, which agents check
TOKEN_PREFIX = "capyjoin_"  # noqa: S105 - a prefix, not a secret


@dataclass(frozen=True)
class JoinToken:
    """What ``capyctl host add`` prints: where to enrol, the CA to pin, and a secret."""

    url: str  # the server's enrolment address, https://HOST:PORT
    fingerprint: str  # of the CA certificate, SHA-256 hex
    host: str
    secret: str

    def encode(self) -> str:
        data = {"u": self.url, "f": self.fingerprint, "h": self.host, "s": self.secret}
        raw = json.dumps(data, separators=(",", ":")).encode()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> JoinToken:
        """Raises ValueError (a one-line reason) for anything that is not a join token."""
        token = token.strip()
        if not token.startswith(TOKEN_PREFIX):
            raise ValueError(f"a join token starts with {TOKEN_PREFIX}")
        body = token[len(TOKEN_PREFIX) :]
        try:
            data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            return cls(str(data["u"]), str(data["f"]), str(data["h"]), str(data["s"]))
        except (ValueError, KeyError, TypeError):
            raise ValueError("the join token is damaged (copy all of it)") from None


def make_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_key(pem: bytes) -> PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("expected an EC private key")
    return key


def make_csr(key: PrivateKey, name: str) -> bytes:
    """A certificate request for ``name`` (the host's registered name)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the certificate's DER form, in hex: what a join token pins."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def write_private(path: Path, data: bytes) -> None:
    """Write a secret file readable by its owner only (0600 from its first byte)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    path.chmod(0o600)


def server_context(cert: Path, key: Path, ca: Path, *, require_client: bool) -> ssl.SSLContext:
    """For a listener: our certificate; with ``require_client``, a client certificate from
    ``ca`` (made for client authentication) is required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if require_client:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    ca: Path,
    cert: Path | None = None,
    key: Path | None = None,
    *,
    pins: Mapping[str, str] | None = None,
) -> ssl.SSLContext:
    """For calls out: the peer must chain to ``ca`` and carry the name we expect. With
    ``pins`` (peer name → SHA-256 of its certificate), it must also be exactly the
    certificate pinned for that name, checked after each handshake: a certificate that was
    replaced or revoked is refused although the CA signed it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(ca)
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    if pins is not None:
        context.capyctl_pins = pins  # type: ignore[attr-defined]
        context.sslsocket_class = _PinnedSocket  # blocking sockets (httpx)
        context.sslobject_class = _PinnedObject  # asyncio and uvloop transports
    return context


class PinMismatchError(ssl.SSLCertVerificationError):
    """The peer's certificate is valid but not the one pinned for its name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "certificate does not match its pin"


def check_pin(pins: Mapping[str, str], name: str | None, der: bytes | None) -> None:
    """Raise PinMismatchError unless ``der`` is the certificate pinned for ``name``."""
    expected = pins.get(name or "")
    if not expected:
        raise PinMismatchError(
            f"host {name}: no certificate is trusted for it (revoked; it must join again)"
        )
    seen = hashlib.sha256(der or b"").hexdigest()
    if not hmac.compare_digest(seen, expected):
        raise PinMismatchError(
            f"host {name}: its certificate ({seen[:16]}…) is not the one it joined with "
            f"({expected[:16]}…): revoked or replaced"
        )


class _PinnedSocket(ssl.SSLSocket):
    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        check_pin(self.context.capyctl_pins, self.server_hostname,  # type: ignore[attr-defined]
                  self.getpeercert(binary_form=True))  # fmt: skip


class _PinnedObject(ssl.SSLObject):
    def do_handshake(self) -> None:
        super().do_handshake()
        check_pin(self.context.capyctl_pins, self.server_hostname,  # type: ignore[attr-defined]
                  self.getpeercert(binary_form=True))  # fmt: skip
