"""The gateway's door to the mesh's meter: requests_per_minute charged here (in a SQLite
file, and in a real Redis server two gateways share), the generation router's token
refusals as OpenAI's 429s that hold no other tenant back, the ledger of what the gateway
serves itself (embeddings, images), and two gateways sharing one Redis sharing one quota.
The tokens of generations are metered by the router: tests/services/llm/test_tenancy.py."""

from __future__ import annotations

import math

import pytest
import redis.asyncio

from tests.conftest import free_port
from tests.services.gateway.conftest import KEY, KEYS, start_gateway
from tests.services.gateway.fakes import EMBEDDING_MODEL, LLM

pytestmark = pytest.mark.service

USER = [{"role": "user", "content": "hi there"}]
ADMIN_KEYS = {**KEYS, "sk-admin": ("ops", ["admin"])}


async def stop(servers) -> None:
    for server in servers:
        await server.drain(0)


async def chat(gateway, key: str = KEY, **extra):
    async with gateway.http(key) as client:
        return await client.post(
            "/v1/chat/completions", json={"model": LLM, "messages": USER, **extra}
        )


async def embed(gateway, key: str, text: str):
    async with gateway.http(key) as client:
        return await client.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": text})


async def test_past_its_requests_per_minute_a_tenant_gets_429_then_the_sdk_retries(tmp_path):
    # 2 per 8 s: a full bucket of 2, then room for one more every 4 s (long enough that a
    # slow machine does not refill it between the refusal and the SDK's call). The
    # arithmetic is the same in every store (tests/mesh/test_buckets.py); sharing one
    # bucket through SQLite and Redis is tests/mesh/test_metering.py's and the two
    # gateways' below.
    gateway, servers = await start_gateway(
        tmp_path,
        tenants={"acme": {"requests_per_minute": 2}},
        limits={"store": f"sqlite:{tmp_path / 'limits.sqlite'}", "window_s": 8},
    )
    try:
        assert [(await chat(gateway)).status_code for _ in range(2)] == [200, 200]
        refused = await chat(gateway)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "requests_per_minute" in error["message"]
        wait_ms = int(refused.headers["retry-after-ms"])
        assert 0 < wait_ms <= 4000
        assert refused.headers["retry-after"] == str(math.ceil(wait_ms / 1000))
        assert len(gateway.generation.requests) == 2  # refused before the mesh
        # Other tenants are not limited by acme's bucket.
        async with gateway.http("sk-embed-only") as other:
            assert (await other.get("/v1/models")).status_code == 200

        client = gateway.sdk(max_retries=2)
        raw = await client.chat.completions.with_raw_response.create(model=LLM, messages=USER)
        assert raw.parse().choices[0].message.content == "Hello, world!"
        assert raw.retries_taken >= 1  # it was refused first, waited as told, then served
        assert len(gateway.generation.requests) == 3
    finally:
        await stop(servers)


@pytest.mark.parametrize(
    ("reason", "kind", "retry"),
    [
        ("INSUFFICIENT_QUOTA", "insufficient_quota", False),
        ("REQUEST_TOO_LARGE", "rate_limit_error", False),
        ("RATE_LIMIT_EXCEEDED", "rate_limit_error", True),
    ],
)
async def test_the_routers_token_refusals_are_openais_429s_and_hold_no_one_else_back(
    tmp_path, reason, kind, retry
):
    gateway, servers = await start_gateway(tmp_path)
    try:
        refused = await chat(gateway, messages=[{"role": "user", "content": f"quota:{reason}"}])
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == (kind, reason.lower())
        assert ("retry-after" in refused.headers) == retry
        # The gateway's channel to the router took no RetryInfo as the router's backpressure:
        # the next tenant's request goes straight through.
        assert (await chat(gateway)).status_code == 200
        assert len(gateway.generation.requests) == 2
    finally:
        await stop(servers)


async def test_two_gateways_on_one_redis_share_every_quota_and_the_ledger(tmp_path, redis_url):
    tenants = {
        "acme": {"requests_per_minute": 2},
        "embedco": {"token_budget": 6},
    }
    keys = {**ADMIN_KEYS, "sk-budget": ("embedco", ["generate", "embed"])}
    limits = {"store": redis_url}
    one, servers = await start_gateway(tmp_path, keys=keys, tenants=tenants, limits=limits)
    try:
        two, more = await start_gateway(tmp_path, limits=limits)
        servers += more
        assert (await chat(one)).status_code == 200
        assert (await chat(two)).status_code == 200
        for gateway in (one, two):  # spent through both, refused on both
            refused = await chat(gateway)
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 20  # 1 request per 30 s
        # 5 characters reserve 2 tokens and use 1 (the fake embedder's count: one an
        # input); then 24 characters reserve 6, more than the 5 left.
        assert (await embed(one, "sk-budget", "abcde")).status_code == 200
        spent = await embed(two, "sk-budget", "x" * 24)
        assert (spent.status_code, spent.json()["error"]["code"]) == (429, "insufficient_quota")

        # One ledger: an admin reads every tenant's usage through either gateway.
        async with two.http("sk-admin") as admin:
            ledger = (await admin.get("/v1/usage")).json()["data"]
        assert ledger == [
            {
                "tenant": "embedco",
                "model": EMBEDDING_MODEL,
                "requests": 1,
                "prompt_tokens": 1,
                "completion_tokens": 0,
                "images": 0,
            },
        ]
        async with one.http(KEY) as tenant:
            assert (await tenant.get("/v1/usage")).json()["data"] == []

        # Redis holds tenant names, never keys or their digests.
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            names = [name async for name in client.scan_iter("aimesh:limits:*")]
            fields = await client.hkeys("aimesh:limits:usage")
            stored = " ".join(names + fields)
            assert "acme" in stored and "embedco" in stored and "sk-" not in stored
        finally:
            await client.aclose()
    finally:
        await stop(servers)


async def test_usage_without_an_admin_scope_is_the_callers_own(tmp_path):
    gateway, servers = await start_gateway(tmp_path, keys=ADMIN_KEYS)
    try:
        await gateway.sdk().embeddings.create(model=EMBEDDING_MODEL, input="abcd")
        await gateway.sdk("sk-embed-only").embeddings.create(model=EMBEDDING_MODEL, input="abc")
        async with gateway.http("sk-embed-only") as client:
            own = (await client.get("/v1/usage")).json()["data"]
        assert [(r["tenant"], r["requests"], r["prompt_tokens"]) for r in own] == [
            ("embedco", 1, 1)
        ]
        async with gateway.http("sk-admin") as client:
            everyone = (await client.get("/v1/usage")).json()["data"]
        assert [r["tenant"] for r in everyone] == ["acme", "embedco"]
        async with gateway.http(None) as client:
            assert (await client.get("/v1/usage")).status_code == 401
    finally:
        await stop(servers)


async def test_an_unreachable_redis_is_503_not_unlimited(tmp_path):
    gateway, servers = await start_gateway(
        tmp_path,
        tenants={"acme": {"requests_per_minute": 100}},
        limits={"store": f"redis://127.0.0.1:{free_port()}/0"},
    )
    try:
        refused = await chat(gateway)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "limits_store_unavailable"
        assert not gateway.generation.requests
        # A tenant without limits never touches the store.
        embedded = await gateway.sdk("sk-embed-only").embeddings.create(
            model=EMBEDDING_MODEL, input="x"
        )
        assert len(embedded.data) == 1
    finally:
        await stop(servers)
