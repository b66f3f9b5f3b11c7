"""A throwaway certificate authority and the certificates it signs, for TLS on one machine
(`aimesh up --tls`, the tests) without a real PKI.

Each mesh identity's certificate names it three ways: its DNS name, `localhost` and
127.0.0.1 (what a loopback caller dials), and the URI `spiffe://aimesh/<name>` (the SPIFFE
form a caller's identity is read from). The edge listener's certificate names only the
hosts clients dial, for server authentication alone: it proves where a client connected,
never who is calling. Keys are EC P-256, written 0600; the CA's key never leaves memory.
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
from mesh.config import EdgeTlsSettings, TlsSettings

VALID_FOR = datetime.timedelta(days=7)
LEAF = (x509.BasicConstraints(ca=False, path_length=None), True)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Whole or not at all: a server reloading its files (mesh/tls.py, Envoy's watched
    SDS directory) or a caller reading them never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    partial.chmod(mode)
    os.replace(partial, path)


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _host_name(host: str) -> x509.GeneralName:
    """An address as an IP SAN (what TLS clients check an address against), else a DNS one."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


class ThrowawayCa:
    """A new CA in `directory` (its certificate as ca.pem) that signs certificates into
    the same directory for as long as this object lives."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name("aimesh throwaway CA")
        ca = self._sign(
            self._name, self._key, [(x509.BasicConstraints(ca=True, path_length=0), True)]
        )
        self.ca_file = directory / "ca.pem"
        _write(self.ca_file, ca.public_bytes(serialization.Encoding.PEM))

    def _sign(
        self,
        subject: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        extensions: list[tuple[x509.ExtensionType, bool]],
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(self._key, hashes.SHA256())

    def _issue(
        self, name: str, names: list[x509.GeneralName], usages: list[x509.ObjectIdentifier]
    ) -> tuple[Path, Path]:
        """A new key and certificate as NAME.key and NAME.pem, the key moved in first: a
        server that reloads at each file moved in sees the new pair complete at the second."""
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = self._sign(
            _name(name),
            key,
            [
                (x509.SubjectAlternativeName(names), False),
                (x509.ExtendedKeyUsage(usages), False),
                LEAF,
            ],
        )
        cert_file, key_file = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        _write(key_file, _key_bytes(key), 0o600)
        _write(cert_file, certificate.public_bytes(serialization.Encoding.PEM))
        return cert_file, key_file

    def identity(self, name: str) -> TlsSettings:
        """A server-and-client certificate naming the mesh identity `name` (mutual TLS)."""
        names = [
            x509.DNSName(name),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.UniformResourceIdentifier(identity_uri(name)),
        ]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert_file, key_file = self._issue(name, names, usages)
        return TlsSettings(cert_file=cert_file, key_file=key_file, ca_file=self.ca_file)

    def listener(self, name: str, hosts: list[str]) -> EdgeTlsSettings:
        """A server certificate for the edge's listener, naming the `hosts` (addresses or
        DNS names) its clients dial; issued again under the same name, it replaces the
        files in place, as a renewal does."""
        names = [_host_name(host) for host in dict.fromkeys(hosts)]
        cert_file, key_file = self._issue(name, names, [ExtendedKeyUsageOID.SERVER_AUTH])
        return EdgeTlsSettings(cert_file=cert_file, key_file=key_file)


def throwaway_pki(directory: Path, services: list[str]) -> dict[str, TlsSettings]:
    """A new CA in `directory` and a server-and-client certificate per service, signed by
    it; each service's TlsSettings (mutual TLS)."""
    ca = ThrowawayCa(directory)
    return {service: ca.identity(service) for service in services}
