"""Whose collection a name means. Each client (x-aimesh-client: the edge key's tenant,
carried by every hop) has a namespace of its own: a collection it creates, upserts into
or deletes from is its own, stored under a name no other client can reach
(`name.t<sha256 of the tenant, 12 hex>`; "." is not allowed in the names clients give).
Calls without a client (the operator's `aimesh ingest`, plaintext callers inside the mesh)
use the shared namespace, the names as given: the knowledge base every tenant's searches
fall back to when they have no collection of that name themselves. So a tenant reads its
own collections and the shared ones, and writes only its own.
"""

from __future__ import annotations

import hashlib

SHARED = ""


def owned(collection: str, tenant: str) -> str:
    """The collection `collection` means when `tenant` writes it."""
    if tenant == SHARED:
        return collection
    return f"{collection}.t{hashlib.sha256(tenant.encode()).hexdigest()[:12]}"
