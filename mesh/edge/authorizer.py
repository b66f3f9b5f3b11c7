"""The edge's authorizer: Envoy asks it (ext_authz over HTTP) about every request to the
mesh's gRPC, gRPC-Web and JSON routes, before any of it goes upstream.

Envoy cannot check a hashed key itself (its api_key_auth filter compares keys in clear
text, written into its config), so this small server beside it does: the key from
`authorization: Bearer KEY` or `x-api-key: KEY` is hashed and looked up in the key file
(mesh/keys.py; re-read when it changes), the method's scope (each service's
ServiceSpec.scopes) must be among the key's, and the answer tells Envoy which tenant the
request is for (`x-aimesh-client`, which every hop carries on and services scope their
data by) and which scopes it holds (`x-aimesh-scopes`), and to drop the key before going
upstream. No key or an unknown one: 401 (UNAUTHENTICATED to a gRPC client); a key without
the scope: 403 (PERMISSION_DENIED); a tenant past its requests_per_minute (the mesh's
meter, mesh/metering.py: one bucket per tenant that the gateway's HTTP API draws from
too, in the [limits] store): 429 (RESOURCE_EXHAUSTED) with retry-after. Keys given in
clear text (`edge.api_keys`, for a machine of one's own) stand for tenants `key-1`,
`key-2`, ... with every scope.

Envoy sends the original method and path (the gRPC method's, the JSON route already
transcoded) under /check and only the headers it is told to; this server reads nothing
else and logs no header.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Iterable, Mapping

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mesh import caller, caller_token
from mesh.config import MeshSettings
from mesh.embedded_http import EmbeddedServer
from mesh.failures import NotReady, QuotaExceeded
from mesh.keys import ALL_SCOPES, KeyStore, Principal, bearer_key, digest
from mesh.ledger import LocalWhileDown, open_store
from mesh.metering import Meter, TenantsFile, warn_unenforced
from mesh.registry import ServiceSpec, discover
from mesh.rpc import split_method

log = logging.getLogger(__name__)

PATH_PREFIX = "/check"
CLIENT_HEADER = caller.METADATA_KEY
SCOPES_HEADER = "x-aimesh-scopes"
# The headers Envoy sends here, and those it copies from an answer onto the request.
KEY_HEADERS = ("authorization", "x-api-key")
# The edge's own identity where a sidecar ends TLS: a token per call, signed with the
# edge's key (mesh/caller_token.py), since Envoy cannot sign one.
TOKEN_HEADER = caller_token.METADATA_KEY
UPSTREAM_HEADERS = (CLIENT_HEADER, SCOPES_HEADER, TOKEN_HEADER)
# A method no spec gives a scope is refused to every key (default deny).
NO_SCOPE = ""
# A shared store is waited for this long per request before this replica limits alone.
SHARED_TIMEOUT_S = 0.25
# /package.Service/Method; an HTTP path such as /v1/models has no dotted package.
GRPC_PATH = re.compile(r"/\w+(?:\.\w+)+/\w+")


def method_scopes(specs: Iterable[ServiceSpec]) -> dict[str, str]:
    """'/pkg.Service/Method' or 'pkg.Service' -> the scope a key needs for it."""
    return {name: scope for spec in specs for name, scope in spec.scopes}


class Keys:
    """The file's keys and the clear-text ones of the settings, as principals."""

    def __init__(self, settings: MeshSettings) -> None:
        edge = settings.edge
        if not edge.api_keys and edge.api_keys_file is None:
            raise ValueError("the edge needs API keys: edge.api_keys_file or edge.api_keys")
        self.file = None if edge.api_keys_file is None else KeyStore(edge.api_keys_file)
        self.plain = {
            digest(key.get_secret_value()): Principal(f"key-{index}", ALL_SCOPES)
            for index, key in enumerate(edge.api_keys, start=1)
        }

    def lookup(self, key: str | None) -> Principal | None:
        if key is None:
            return None
        found = self.plain.get(digest(key))
        if found is None and self.file is not None:
            found = self.file.lookup(key)
        return found


def edge_meter(settings: MeshSettings) -> Meter:
    """The mesh's meter for this edge: the [limits] store, which with Redis falls back to
    this replica's own buckets while Redis does not answer (a Redis outage loosens the
    requests limit rather than refusing every request)."""
    limits = settings.limits
    if limits.store == "memory" or limits.store.startswith("sqlite"):
        return Meter.from_settings(limits, settings.cache_dir)
    shared = open_store(limits.store, settings.cache_dir, timeout_s=SHARED_TIMEOUT_S)
    return Meter(LocalWhileDown(shared), TenantsFile(limits.tenants_file), window_s=limits.window_s)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """`authorization: Bearer KEY`, else `x-api-key: KEY`."""
    return bearer_key(headers) or headers.get("x-api-key") or None


def needed_scope(path: str, scopes: Mapping[str, str]) -> str | None:
    """The scope a gRPC method needs: its own, else its service's, else NO_SCOPE (nobody
    may call it). None for an HTTP path (the gateway's API where it checks no keys of its
    own): any valid key."""
    if not GRPC_PATH.fullmatch(path):
        return None
    return scopes.get(path, scopes.get(split_method(path)[0], NO_SCOPE))


def _refusal(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _too_many(message: str, wait_s: float) -> JSONResponse:
    refused = _refusal(429, message)
    refused.headers["retry-after"] = str(max(1, math.ceil(wait_s)))
    # Envoy would say UNAVAILABLE to a gRPC client for a 429, which clients and breakers
    # read as a sick server; this is the caller's backpressure.
    refused.headers["grpc-status"] = str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    refused.headers["grpc-message"] = message
    return refused


def build_app(
    keys: Keys,
    scopes: Mapping[str, str],
    meter: Meter,
    tokens: caller_token.TokenSigner | None = None,
) -> Starlette:

    async def check(request: Request) -> Response:
        path = request.url.path.removeprefix(PATH_PREFIX) or "/"
        principal = keys.lookup(presented_key(request.headers))
        if principal is None:
            return _refusal(401, "missing or unknown API key (authorization: Bearer KEY)")
        needed = needed_scope(path, scopes)
        if needed is not None and needed not in principal.scopes:
            reason = f"the {needed!r} scope" if needed else "a scope no key has"
            return _refusal(403, f"this key may not call {path}: it needs {reason}")
        try:
            await meter.admit_request(principal.tenant)
        except QuotaExceeded as refused:
            return _too_many(refused.message, refused.retry_after_s or meter.window_s)
        except NotReady as down:
            return _refusal(503, down.message)
        headers = {
            CLIENT_HEADER: principal.tenant,
            SCOPES_HEADER: ",".join(sorted(principal.scopes)),
            "x-envoy-auth-headers-to-remove": ",".join(KEY_HEADERS),
        }
        if tokens is not None and needed is not None:  # a gRPC method of the mesh
            headers[TOKEN_HEADER] = tokens.token(path)
        return Response(status_code=200, headers=headers)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route(PATH_PREFIX + "{rest:path}", check, methods=methods)])


class AuthorizerServer:
    """The authorizer on 127.0.0.1 (Envoy's side of the pod or machine), in this loop,
    with every installed service's scopes: a method's scope does not depend on which
    services this edge fronts."""

    def __init__(self, settings: MeshSettings) -> None:
        self.meter = edge_meter(settings)
        if settings.edge.api_keys_file is not None:
            warn_unenforced(settings.edge.api_keys_file, settings.limits)
        tls = settings.tls
        tokens = caller_token.token_signer(tls) if tls is not None and tls.caller_tokens else None
        config = uvicorn.Config(
            build_app(Keys(settings), method_scopes(discover().values()), self.meter, tokens),
            host="127.0.0.1",
            port=settings.edge.authorizer_port,
            log_config=None,
            access_log=False,
            lifespan="off",
        )
        self.server = EmbeddedServer(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(), name="edge-authorizer")
        while not self.server.started:
            if self.task.done():
                await self.task
                raise OSError("the edge authorizer did not start")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        await self.meter.close()
