"""Caller identity where TLS ends before the process: a short-lived token signed with the
caller's mesh key, in place of the client certificate the handshake would have shown.

Behind a sidecar proxy (Istio, Linkerd) or any hop that terminates TLS, a server sees
plaintext and no peer certificate, so mesh/authz.py has no caller to check. With
`[tls] caller_tokens = true`, processes listen and dial in plaintext (the sidecars encrypt
the hop) and every call carries `x-aimesh-caller-token`: a JWT (RFC 7519, ES256, PyJWT)
whose `x5c` header is the caller's certificate, `sub` its identity URI
(`spiffe://aimesh/<name>`), `aud` the gRPC method it is for, valid for TOKEN_TTL_S. The
callee accepts it when the certificate was issued by the mesh CA and is valid now, the
token is signed by that certificate's key, its `sub` is a URI the certificate holds and its
`aud` is the method being called. A stolen token opens one method for at most 90 s (its
minute and LEEWAY_S for clocks that disagree); the key never leaves the caller.

The same certificate and key files as for mutual TLS, re-read when they change: a renewed
certificate signs the next token. Certificates must be issued directly by a CA of
`ca_file` (cert-manager's CA issuer, mesh/pki.py); chains through intermediates are not
followed.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from mesh.authz import IDENTITY_PREFIX
from mesh.tls import files_stamp

if TYPE_CHECKING:
    import grpc

    from mesh.config import TlsSettings

METADATA_KEY = "x-aimesh-caller-token"
ALGORITHM = "ES256"
TOKEN_TTL_S = 60
# A token is reused for calls to its method until this much of its life is left.
RENEW_BEFORE_S = 30
# Clocks of two pods may disagree by this much.
LEEWAY_S = 30
# Tokens already verified (by their text) and certificates already checked (by digest):
# a caller sends the same token for half a minute, so most calls verify nothing. Bounded.
VERIFIED_TOKENS = 4096
CHECKED_CERTIFICATES = 256
SIGNED_TOKENS = 256


class TokenSigner:
    """The caller's side: a token per method, renewed before it runs out."""

    def __init__(self, tls: TlsSettings, clock: Callable[[], float] = time.time) -> None:
        self.tls = tls
        self.clock = clock
        self._stamp: tuple[int, ...] = ()
        # method -> (token, expires); bounded, since the edge's authorizer signs for
        # whatever method path a client with a key sends.
        self._tokens: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def _load(self) -> None:
        stamp = files_stamp(self.tls)
        if stamp == self._stamp:
            return
        key = serialization.load_pem_private_key(self.tls.key_file.read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{self.tls.key_file}: caller tokens need an EC (P-256) key")
        certificate = x509.load_pem_x509_certificate(self.tls.cert_file.read_bytes())
        self._key, self._identity = key, _identity_uri(certificate)
        self._x5c = base64.b64encode(certificate.public_bytes(serialization.Encoding.DER))
        self._stamp = stamp
        self._tokens.clear()

    def token(self, method: str) -> str:
        now = self.clock()
        held = self._tokens.get(method)
        if (
            held is not None
            and held[1] - now > RENEW_BEFORE_S
            and self._stamp == files_stamp(self.tls)
        ):
            return held[0]
        self._load()
        claims = {
            "sub": self._identity,
            "aud": method,
            "iat": int(now),
            "exp": int(now) + TOKEN_TTL_S,
        }
        token = jwt.encode(
            claims, self._key, algorithm=ALGORITHM, headers={"x5c": [self._x5c.decode()]}
        )
        _remember(self._tokens, method, (token, now + TOKEN_TTL_S), SIGNED_TOKENS)
        return token


_SIGNERS: dict[tuple[Path, Path, Path], TokenSigner] = {}


def token_signer(tls: TlsSettings) -> TokenSigner:
    """One signer per certificate in a process, shared by its channels (and their tokens);
    a process holds one or two certificates, so the table stays small."""
    files = (tls.cert_file, tls.key_file, tls.ca_file)
    signer = _SIGNERS.get(files)
    if signer is None:
        signer = _SIGNERS[files] = TokenSigner(tls)
    return signer


def _identity_uri(certificate: x509.Certificate) -> str:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        names = None
    uris = [] if names is None else names.value.get_values_for_type(x509.UniformResourceIdentifier)
    found = [uri for uri in uris if uri.startswith(IDENTITY_PREFIX)]
    if not found:
        raise ValueError(f"the certificate names no {IDENTITY_PREFIX}<name> identity")
    return found[0]


@dataclass(frozen=True)
class _Checked:
    identity: str
    public_key: ec.EllipticCurvePublicKey
    not_after: float


class TokenVerifier:
    """The callee's side: the caller's mesh name from its token, or None."""

    def __init__(self, tls: TlsSettings, clock: Callable[[], float] = time.time) -> None:
        self.tls = tls
        self.clock = clock
        self._stamp: tuple[int, ...] = ()
        self._tokens: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._certificates: OrderedDict[bytes, _Checked] = OrderedDict()

    def _authorities(self) -> list[x509.Certificate]:
        stamp = files_stamp(self.tls)
        if stamp != self._stamp:  # a rotated CA: nothing checked against the old one stays
            self._cas = [
                ca
                for ca in x509.load_pem_x509_certificates(self.tls.ca_file.read_bytes())
                if _is_ca(ca)
            ]
            self._stamp = stamp
            self._tokens.clear()
            self._certificates.clear()
        return self._cas

    def identity(self, context: grpc.aio.ServicerContext, method: str) -> str | None:
        token = dict(context.invocation_metadata() or ()).get(METADATA_KEY)
        if not isinstance(token, str) or not token:
            return None
        return self.verify(token, method)

    def verify(self, token: str, method: str) -> str | None:
        """The mesh name the token proves for a call of `method`, or None."""
        now = self.clock()
        authorities = self._authorities()
        held = self._tokens.get((token, method))
        if held is not None and held[1] > now - LEEWAY_S:
            return held[0]
        try:
            checked = self._certificate(jwt.get_unverified_header(token), authorities, now)
            claims = jwt.decode(
                token,
                checked.public_key,
                algorithms=[ALGORITHM],
                audience=method,
                # Times are checked below, on this verifier's clock.
                options={
                    "require": ["sub", "aud", "iat", "exp"],
                    "verify_exp": False,
                    "verify_iat": False,
                },
            )
            issued, expires = float(claims["iat"]), float(claims["exp"])
        except (jwt.PyJWTError, ValueError, TypeError, KeyError, IndexError):
            return None
        if claims["sub"] != checked.identity:
            return None
        if not issued - LEEWAY_S <= now <= expires + LEEWAY_S or expires - issued > TOKEN_TTL_S:
            return None
        name = checked.identity.removeprefix(IDENTITY_PREFIX)
        _remember(
            self._tokens, (token, method), (name, min(expires, checked.not_after)), VERIFIED_TOKENS
        )
        return name

    def _certificate(
        self, header: dict, authorities: list[x509.Certificate], now: float
    ) -> _Checked:
        der = base64.b64decode(header["x5c"][0], validate=True)
        digest = hashlib.sha256(der).digest()
        checked = self._certificates.get(digest)
        if checked is not None and checked.not_after > now:
            return checked
        certificate = x509.load_der_x509_certificate(der)
        moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
        if not certificate.not_valid_before_utc <= moment <= certificate.not_valid_after_utc:
            raise ValueError("the certificate is not valid now")
        if not any(_issued_by(certificate, ca) for ca in authorities):
            raise ValueError("the certificate is not the mesh CA's")
        key = certificate.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ValueError("caller tokens are signed with EC keys")
        checked = _Checked(
            _identity_uri(certificate), key, certificate.not_valid_after_utc.timestamp()
        )
        _remember(self._certificates, digest, checked, CHECKED_CERTIFICATES)
        return checked


def _remember(table: OrderedDict, key: Any, value: Any, limit: int) -> None:
    """Puts `value` under `key` as the newest entry, dropping the oldest past `limit`."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


def _is_ca(certificate: x509.Certificate) -> bool:
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _issued_by(certificate: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
