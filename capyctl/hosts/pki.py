"""The server's private CA: made once in the data dir, it signs the server's certificate
and each host's, and join tokens pin it by fingerprint.

Files, in ``<data dir>/pki``: ``ca.key`` and ``server.key`` (mode 0600), ``ca.crt``,
``server.crt``. The CA signs host certificates for server authentication only, with the
host's registered name in their SAN; the server's certificate also serves for client
authentication, which is what agents require of whoever calls them.
"""

from __future__ import annotations

import datetime as dt
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings

from hostagent import tls
from hostagent.datadir import make_private_dir

SERVER_NAME = tls.SERVER_NAME
CA_DAYS = 3650
CERT_DAYS = 825
_lock = threading.Lock()


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    def fingerprint(self) -> str:
        return tls.fingerprint(self.ca_cert.read_bytes())


def pki(directory: Path | None = None) -> Pki:
    """The CA in the data dir, made on first use (with the server's certificate)."""
    found = Pki(directory or Path(settings.DATA_DIR) / "pki")
    with _lock:
        if not found.ca_cert.exists():
            make_private_dir(found.directory)
            _make_ca(found)
    return found


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _make_ca(where: Pki) -> None:
    key = tls.make_key()
    now = dt.datetime.now(dt.UTC)
    subject = _name(f"CapyCTL CA {secrets.token_hex(4)}")
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    tls.write_private(where.ca_key, tls.key_pem(key))
    server_key = tls.make_key()
    server_cert = sign(
        where,
        server_key.public_key(),
        SERVER_NAME,
        client=True,
        ca=(cert, key),
    )
    tls.write_private(where.server_key, tls.key_pem(server_key))
    where.server_cert.write_bytes(server_cert)
    where.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))  # last: "made"


def sign(
    where: Pki,
    public_key: ec.EllipticCurvePublicKey,
    name: str,
    *,
    client: bool = False,
    days: float = CERT_DAYS,
    ca: tuple[x509.Certificate, tls.PrivateKey] | None = None,
) -> bytes:
    """A certificate for ``name`` (its SAN), signed by the CA; ``client`` adds client
    authentication (the server's own certificate only). Negative ``days``: already
    expired (for tests of refusal)."""
    ca_cert, ca_key = ca or (
        x509.load_pem_x509_certificate(where.ca_cert.read_bytes()),
        tls.load_key(where.ca_key.read_bytes()),
    )
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH]
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    start = min(now, now + dt.timedelta(days=days)) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - dt.timedelta(days=1) if days < 0 else start)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def sign_request(where: Pki, csr_pem: bytes, name: str) -> bytes:
    """Sign a host's certificate request for its registered ``name`` (whatever the
    request asked for: the name comes from the join token's host)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise ValueError(f"the certificate request is not valid PEM: {exc}") from None
    if not csr.is_signature_valid:
        raise ValueError("the certificate request's signature does not verify")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ValueError("the certificate request must carry an EC (P-256) key")
    return sign(where, public_key, name)
