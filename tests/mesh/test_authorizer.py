"""The edge's authorizer as Envoy asks it (mesh/edge/authorizer.py): keys hashed and
scoped, every method the edge serves given a scope, the tenant and scopes in the answer."""

from __future__ import annotations

import httpx
import pytest
from pydantic import SecretStr

from mesh.config import LimitsSettings, MeshSettings
from mesh.edge import api
from mesh.edge.authorizer import (
    CLIENT_HEADER,
    PATH_PREFIX,
    SCOPES_HEADER,
    Keys,
    build_app,
    edge_meter,
    method_scopes,
    needed_scope,
)
from mesh.keys import ALL_SCOPES
from mesh.ledger import MemoryStore
from mesh.metering import Meter, TenantsFile
from mesh.registry import discover
from tests.services.gateway.conftest import write_keys

pytestmark = pytest.mark.unit

SEARCH = "/aimesh.retrieval.v1.RetrievalService/Search"
DELETE = "/aimesh.retrieval.v1.RetrievalService/Delete"


def test_every_method_the_edge_serves_needs_a_scope_a_key_can_hold():
    scopes = method_scopes(discover().values())
    names = [name for spec in discover().values() for name in spec.edge_services]
    for service in api.load_services(names):
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            assert needed_scope(path, scopes) in ALL_SCOPES, path
    assert needed_scope(DELETE, scopes) == "write" and needed_scope(SEARCH, scopes) == "read"
    assert needed_scope("/aimesh.llm.v1.DecodeService/Decode", scopes) == ""  # nobody
    assert needed_scope("/v1/chat/completions", scopes) is None  # any valid key


async def ask(app, path: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://authorizer") as client:
        return await client.post(PATH_PREFIX + path, headers=headers)


async def test_keys_from_the_file_and_the_settings_answer_with_tenant_and_scopes(tmp_path):
    keys_file = tmp_path / "keys.json"
    write_keys(keys_file, {"sk-read": ("acme", ["read"]), "sk-write": ("ops", ["write"])})
    settings = MeshSettings()
    settings.edge.api_keys = [SecretStr("plain")]
    settings.edge.api_keys_file = keys_file
    app = build_app(Keys(settings), method_scopes(discover().values()), any_meter())

    allowed = await ask(app, SEARCH, authorization="Bearer sk-read")
    assert allowed.status_code == 200
    assert allowed.headers[CLIENT_HEADER] == "acme" and allowed.headers[SCOPES_HEADER] == "read"
    assert "authorization" in allowed.headers["x-envoy-auth-headers-to-remove"]
    assert (await ask(app, DELETE, authorization="Bearer sk-read")).status_code == 403
    assert (await ask(app, DELETE, **{"x-api-key": "sk-write"})).status_code == 200
    plain = await ask(app, DELETE, authorization="Bearer plain")
    assert plain.status_code == 200 and plain.headers[CLIENT_HEADER] == "key-1"
    assert plain.headers[SCOPES_HEADER] == ",".join(sorted(ALL_SCOPES))
    assert (await ask(app, SEARCH, authorization="Bearer nope")).status_code == 401
    assert (await ask(app, SEARCH)).status_code == 401
    assert (await ask(app, "/v1/models", authorization="Bearer sk-write")).status_code == 200
    internal = await ask(app, "/aimesh.llm.v1.KvCacheService/Pull", authorization="Bearer plain")
    assert internal.status_code == 403


def rated(tmp_path, store: str = "memory") -> MeshSettings:
    """An edge whose key file also sets the tenants' limits ([limits] tenants_file)."""
    keys_file = tmp_path / "keys.json"
    write_keys(
        keys_file,
        {"k": ("t", ["read"]), "u": ("free", ["read"])},
        {"t": {"requests_per_minute": 2}},
    )
    settings = MeshSettings(limits=LimitsSettings(tenants_file=keys_file, store=store))
    settings.edge.api_keys_file = keys_file
    return settings


def any_meter() -> Meter:
    return Meter(MemoryStore(), TenantsFile(None))


async def test_a_tenant_past_its_requests_per_minute_waits(tmp_path, buckets_clock):
    """The rate the tenants file gives the tenant ([tenants.t] requests_per_minute, one
    bucket with the gateway's): its minute is the burst, then 429 with retry-after."""
    now = buckets_clock
    settings = rated(tmp_path)
    app = build_app(Keys(settings), method_scopes(discover().values()), edge_meter(settings))
    codes = [(await ask(app, SEARCH, authorization="Bearer k")).status_code for _ in range(2)]
    assert codes == [200, 200]
    refused = await ask(app, SEARCH, authorization="Bearer k")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "30"
    assert refused.headers["grpc-status"] == "8"  # RESOURCE_EXHAUSTED, not UNAVAILABLE
    assert (await ask(app, SEARCH, authorization="Bearer u")).status_code == 200  # unmetered
    now[0] += 30
    assert (await ask(app, SEARCH, authorization="Bearer k")).status_code == 200
    assert (await ask(app, SEARCH, authorization="Bearer k")).status_code == 429


@pytest.mark.service  # a real redis-server
async def test_edge_replicas_on_one_redis_share_a_tenants_minute(tmp_path, redis_url):
    """Two authorizers (two edge replicas) on one real Redis: the tenant's 2 requests per
    minute are 2 in all, not 2 per replica."""
    settings = rated(tmp_path, redis_url)
    keys, scopes = Keys(settings), method_scopes(discover().values())
    rates = [edge_meter(settings) for _ in range(2)]
    first, second = (build_app(keys, scopes, replica) for replica in rates)
    try:
        assert (await ask(first, SEARCH, authorization="Bearer k")).status_code == 200
        assert (await ask(second, SEARCH, authorization="Bearer k")).status_code == 200
        assert (await ask(first, SEARCH, authorization="Bearer k")).status_code == 429
        assert (await ask(second, SEARCH, authorization="Bearer k")).status_code == 429
    finally:
        for replica in rates:
            await replica.close()


async def test_where_a_sidecar_ends_tls_the_answer_carries_the_edges_token(tmp_path):
    """Envoy cannot sign: the authorizer adds a token naming `edge` for the very method
    allowed (mesh/caller_token.py); the gateway's HTTP paths get none."""
    from mesh.authz import EDGE
    from mesh.caller_token import TokenSigner, TokenVerifier
    from mesh.edge.authorizer import TOKEN_HEADER
    from mesh.pki import throwaway_pki

    pki = throwaway_pki(tmp_path / "pki", [EDGE, "retrieval"])
    settings = MeshSettings()
    settings.edge.api_keys = [SecretStr("plain")]
    app = build_app(
        Keys(settings),
        method_scopes(discover().values()),
        any_meter(),
        tokens=TokenSigner(pki[EDGE]),
    )
    allowed = await ask(app, SEARCH, authorization="Bearer plain")
    verifier = TokenVerifier(pki["retrieval"])
    assert verifier.verify(allowed.headers[TOKEN_HEADER], SEARCH) == EDGE
    assert verifier.verify(allowed.headers[TOKEN_HEADER], DELETE) is None
    http = await ask(app, "/v1/models", authorization="Bearer plain")
    assert http.status_code == 200 and TOKEN_HEADER not in http.headers
    refused = await ask(app, SEARCH, authorization="Bearer nope")
    assert TOKEN_HEADER not in refused.headers
