"""The gateway's API keys: mesh/keys.py's file of digests, one key model with the edge
(a tenant's limits are the meter's: mesh/metering.py). Without a key file, the gateway is
open to the anonymous tenant."""

from __future__ import annotations

from mesh.keys import ALL_SCOPES, KeyStore, Principal

__all__ = ["ANONYMOUS", "KeyStore", "OpenAccess", "Principal"]

ANONYMOUS = "anonymous"


class OpenAccess:
    """No key file configured: every caller is the anonymous tenant with every scope (a
    gateway on loopback for one user, as vLLM without --api-key)."""

    def lookup(self, key: str | None) -> Principal | None:
        return Principal(ANONYMOUS, ALL_SCOPES)
