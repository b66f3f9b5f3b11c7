"""A throwaway certificate authority and one certificate per service, for TLS on one
machine (`aimesh up --tls`, the tests) without a real PKI.

Each service's certificate names it three ways: its DNS name, `localhost` and 127.0.0.1
(what a loopback caller dials), and the URI `spiffe://aimesh/<service>` (the SPIFFE form a
caller's identity is read from). Keys are EC P-256, written 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh.authz import identity_uri
from mesh.config import TlsSettings

VALID_FOR = datetime.timedelta(days=7)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Whole or not at all: a server reloading its files (mesh/tls.py) or a caller
    reading them never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    partial.chmod(mode)
    os.replace(partial, path)


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    extensions: list[tuple[x509.ExtensionType, bool]],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def throwaway_pki(directory: Path, services: list[str]) -> dict[str, TlsSettings]:
    """A new CA in `directory` and a server-and-client certificate per service, signed by
    it; each service's TlsSettings (mutual TLS)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("aimesh throwaway CA")
    ca = _certificate(
        ca_name,
        ca_key,
        ca_name,
        ca_key,
        [(x509.BasicConstraints(ca=True, path_length=0), True)],
    )
    ca_file = directory / "ca.pem"
    _write(ca_file, ca.public_bytes(serialization.Encoding.PEM))
    settings = {}
    for service in services:
        key = ec.generate_private_key(ec.SECP256R1())
        names = x509.SubjectAlternativeName(
            [
                x509.DNSName(service),
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.UniformResourceIdentifier(identity_uri(service)),
            ]
        )
        usage = x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        )
        certificate = _certificate(
            _name(service),
            key,
            ca_name,
            ca_key,
            [
                (names, False),
                (usage, False),
                (x509.BasicConstraints(ca=False, path_length=None), True),
            ],
        )
        cert_file, key_file = directory / f"{service}.pem", directory / f"{service}.key"
        _write(cert_file, certificate.public_bytes(serialization.Encoding.PEM))
        _write(key_file, _key_bytes(key), 0o600)
        settings[service] = TlsSettings(cert_file=cert_file, key_file=key_file, ca_file=ca_file)
    return settings
