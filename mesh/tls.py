"""TLS and mutual TLS for the mesh's gRPC servers and channels, from PEM files.

`[tls]` in the mesh config names this process's certificate and key and the CA every mesh
certificate is signed by: servers listen with TLS and, with `require_client_cert`, accept
only callers presenting a certificate of that CA (mTLS); channels check the server's
certificate against the CA and present their own. Without `[tls]` everything stays
plaintext, the loopback default of `aimesh up`.

A server reads its files again when they change (checked at each new handshake), so a
rotated certificate (a renewed Kubernetes Secret, cert-manager) takes effect without a
restart; a channel reads them when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from mesh.config import TlsSettings


@dataclass
class _Loaded:
    stamp: tuple[int, ...]
    configuration: grpc.ServerCertificateConfiguration


def files_stamp(tls: TlsSettings) -> tuple[int, ...]:
    """The certificate, key and CA files' modification times: changed when any is
    rotated."""
    return tuple(path.stat().st_mtime_ns for path in (tls.cert_file, tls.key_file, tls.ca_file))


def _server_configuration(tls: TlsSettings) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
        root_certificates=tls.ca_file.read_bytes(),
    )


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """Credentials that reload the files when their modification times change; files that
    cannot be read at a reload leave the last good ones in use."""
    loaded = _Loaded(files_stamp(tls), _server_configuration(tls))

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = files_stamp(tls)
            if stamp == loaded.stamp:
                return None
            loaded.configuration, loaded.stamp = _server_configuration(tls), stamp
        except OSError:
            return None
        return loaded.configuration

    return grpc.dynamic_ssl_server_credentials(
        loaded.configuration, fetch, require_client_authentication=tls.require_client_cert
    )


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_file.read_bytes(),
        private_key=tls.key_file.read_bytes(),
        certificate_chain=tls.cert_file.read_bytes(),
    )


def terminates_here(tls: TlsSettings | None) -> bool:
    """Whether this process speaks TLS itself (else plaintext: none configured, or a
    sidecar's, mesh/caller_token.py)."""
    return tls is not None and not tls.caller_tokens


def plain_channel(target: str, tls: TlsSettings | None) -> grpc.aio.Channel:
    """A channel without the mesh's interceptors or breaker (health probes, GetInfo, load
    polls: one-off looks that must not trip a breaker), over TLS when `tls` is set."""
    if tls is None or not terminates_here(tls):
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, channel_credentials(tls))


def tls_environment(tls: TlsSettings) -> dict[str, str]:
    """`[tls]` as the environment of a child process (`aimesh serve` reads AIMESH_TLS__*)."""
    return {
        "AIMESH_TLS__CERT_FILE": str(tls.cert_file),
        "AIMESH_TLS__KEY_FILE": str(tls.key_file),
        "AIMESH_TLS__CA_FILE": str(tls.ca_file),
        "AIMESH_TLS__CALLER_TOKENS": "true" if tls.caller_tokens else "false",
    }
