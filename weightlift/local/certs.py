"""X.509 for the local stack: a CA, certificates it signs, PEM. One place for the control
plane's certificates (cluster.py) and the LWS webhook's (lws.py). `cryptography` is imported
when a certificate is made, so importing the stack stays light."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any


def pem(obj: Any) -> bytes:
    """A private key (PKCS#8, unencrypted) or a certificate, as PEM."""
    from cryptography.hazmat.primitives import serialization

    if hasattr(obj, "private_bytes"):
        key: bytes = obj.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return key
    cert: bytes = obj.public_bytes(serialization.Encoding.PEM)
    return cert


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # clocks a little behind
    return now, now + dt.timedelta(days=days)


def new_ca(common_name: str, days: int = 365) -> tuple[Any, Any]:
    """A self-signed CA: (its EC P-256 key, its certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    start, end = _validity(days)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def signed(
    ca_key: Any,
    ca_cert: Any,
    common_name: str,
    *,
    server_names: Sequence[Any] = (),
    orgs: Sequence[str] = (),
    days: int = 365,
) -> tuple[Any, Any]:
    """A certificate signed by the CA: (its EC P-256 key, the certificate). With
    `server_names` (x509.DNSName / x509.IPAddress) it serves TLS; without, it is a client
    certificate (the API server takes CN as the user and O as its groups)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    start, end = _validity(days)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )
    if server_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(list(server_names)), critical=False
        )
    purpose = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())
