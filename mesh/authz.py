"""Who may call what inside the mesh: each service's declared allow-list, checked against
the identity in the caller's mTLS certificate.

A caller is named by the URI `spiffe://aimesh/<name>` in its certificate (mesh/pki.py,
cert-manager's `uris`), where `<name>` is a service, `edge` (Envoy) or `aimesh-cli` (an
operator's tools). Each ServiceSpec lists, per proto service or per method, the names
allowed to call it (`ServiceSpec.callers`); a test checks those lists against the
services' declared dependencies, so the allow-lists are the call graph written down on the
callee's side. Health, reflection and GetInfo are open to every certificate of the CA.

Checked only when the server runs mutual TLS (`[tls]` with `require_client_cert`): over
plaintext, the loopback default, a caller has no identity to check. A refusal is
UNAUTHENTICATED (no identity) or PERMISSION_DENIED (not on the list), with ErrorInfo, and is
never a breaker failure (mesh/breaker.py counts neither code): one misconfigured caller
must not open the circuit for everyone else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import Counter

from mesh.failures import PermissionDenied, Unauthenticated

if TYPE_CHECKING:  # not at run time: service specs import this module and load no grpc
    import grpc

IDENTITY_PREFIX = "spiffe://aimesh/"
# Envoy at the edge; the only caller of a service's edge_services besides the operator.
EDGE = "edge"
# The operator's command-line tools (`aimesh up --tls` makes its certificate): they reach
# what the edge exposes, writes included (which the edge grants only to write-scoped keys).
OPERATOR = "aimesh-cli"
# Every identity of the CA (a diagnostic service such as echo).
ANYONE = "*"

REFUSED = Counter(
    "aimesh_authz_refused_total",
    "Calls refused before their handler: no caller identity, or one not on the method's "
    "allow-list.",
    ["grpc_method", "caller", "reason"],
)


def identity_uri(name: str) -> str:
    return f"{IDENTITY_PREFIX}{name}"


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's mesh name from its certificate's spiffe://aimesh/ URI; None when it
    presented no certificate or one without such a name."""
    for value in context.auth_context().get("peer_spiffe_id", ()):
        uri = value.decode(errors="replace")
        if uri.startswith(IDENTITY_PREFIX):
            return uri.removeprefix(IDENTITY_PREFIX)
    return None


def certificate_identity(context: grpc.aio.ServicerContext, method: str) -> str | None:
    """An Identify by the caller's mTLS certificate (whatever the method)."""
    return peer_identity(context)


# How a server learns a caller's mesh name for a call of a method: from its certificate
# (mutual TLS) or from the token it signed (mesh/caller_token.py, TLS ended by a sidecar).
Identify = Callable[["grpc.aio.ServicerContext", str], "str | None"]


class Policy:
    """One server's allow-lists: a method's own entry wins over its proto service's; a
    method with neither is refused to everyone (default deny)."""

    def __init__(
        self,
        callers: Iterable[tuple[str, Iterable[str]]],
        identify: Identify = certificate_identity,
    ) -> None:
        self._callers: Mapping[str, frozenset[str]] = {
            scope: frozenset(names) for scope, names in callers
        }
        self.identify = identify

    def callers_of(self, method: str) -> frozenset[str]:
        found = self._callers.get(method)
        if found is None:
            service = method.lstrip("/").partition("/")[0]  # mesh.rpc.split_method, sans grpc
            found = self._callers.get(service, frozenset())
        return found

    def check(self, method: str, allowed: frozenset[str], caller: str | None) -> None:
        """Raises the refusal for `caller` on `method` (whose allow-list is `allowed`)."""
        if caller is None:
            REFUSED.labels(method, "", "UNAUTHENTICATED").inc()
            raise Unauthenticated(
                f"{method} needs a client certificate naming a mesh identity "
                f"({IDENTITY_PREFIX}<name>)"
            )
        if caller in allowed or ANYONE in allowed:
            return
        REFUSED.labels(method, caller, "CALLER_NOT_ALLOWED").inc()
        raise PermissionDenied(
            f"{caller!r} may not call {method}; allowed: {', '.join(sorted(allowed)) or 'none'}",
            reason="CALLER_NOT_ALLOWED",
            metadata={"caller": caller, "method": method},
        )
