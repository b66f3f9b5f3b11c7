"""Per-tenant limits and the usage ledger, in the in-process store and in a real Redis
server (the shared one): requests and tokens per minute as token buckets, the lifetime
token budget, 429s the openai SDK's own retry honours, and two gateways sharing one Redis
sharing one quota."""

from __future__ import annotations

import math

import openai
import pytest
import redis.asyncio

from tests.conftest import free_port
from tests.services.gateway.conftest import KEY, KEYS, start_gateway
from tests.services.gateway.fakes import LLM

pytestmark = pytest.mark.service

USER = [{"role": "user", "content": "hi there"}]  # 8 characters: a 2-token estimate
# The fake's "hi there" reply: 2 prompt + 4 completion tokens.
USED = 6
ADMIN_KEYS = {**KEYS, "sk-admin": ("ops", ["admin"])}


@pytest.fixture(params=["memory", "redis"])
def store(request) -> str:
    return "memory" if request.param == "memory" else request.getfixturevalue("redis_url")


async def stop(servers) -> None:
    for server in servers:
        await server.drain(0)


async def chat(gateway, key: str = KEY, **extra):
    async with gateway.http(key) as client:
        return await client.post(
            "/v1/chat/completions", json={"model": LLM, "messages": USER, **extra}
        )


async def test_past_its_requests_per_minute_a_tenant_gets_429_then_the_sdk_retries(tmp_path, store):
    # 2 per 4 s: a full bucket of 2, then room for one more every 2 s (long enough that a
    # slow machine does not refill it between the refusal and the SDK's call).
    gateway, servers = await start_gateway(
        tmp_path,
        tenants={"acme": {"requests_per_minute": 2}},
        limits_store=store,
        limit_window_s=4,
    )
    try:
        assert [(await chat(gateway)).status_code for _ in range(2)] == [200, 200]
        refused = await chat(gateway)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "requests_per_minute" in error["message"]
        wait_ms = int(refused.headers["retry-after-ms"])
        assert 0 < wait_ms <= 2000
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


async def test_tokens_per_minute_reserve_max_tokens_and_settle_to_the_real_usage(tmp_path, store):
    # 20 tokens a minute (1/3 a second: no refill worth counting here).
    gateway, servers = await start_gateway(
        tmp_path,
        tenants={"acme": {"tokens_per_minute": 20}},
        limits_store=store,
        reserve_tokens=5,
    )
    try:
        # Each reserves 2 + 10 = 12 and is settled to 6: 20 -> 14 -> 8.
        assert (await chat(gateway, max_tokens=10)).status_code == 200
        assert (await chat(gateway, max_tokens=10)).status_code == 200
        refused = await chat(gateway, max_tokens=10)  # 12 > 8
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "tokens_per_minute" in refused.json()["error"]["message"]
        # (12 - 8) tokens at 1/3 a second: about 12 s.
        assert 10 <= int(refused.headers["retry-after"]) <= 13
        # A smaller request still fits: 2 + 2 reserved.
        assert (await chat(gateway, max_tokens=2)).status_code == 200
        # One that could never fit the bucket says so, with no time to retry at.
        too_big = await chat(gateway, max_tokens=100)
        assert too_big.status_code == 429
        assert too_big.json()["error"]["code"] == "request_too_large"
        assert "retry-after" not in too_big.headers
        assert len(gateway.generation.requests) == 3
        # Without max_tokens the reservation (reserve_tokens) becomes the request's limit:
        # no generation, streamed or not, runs past what it reserved. (A second gateway
        # on the same key file, acme's limit with it, and a store of its own.)
        gateway2, servers2 = await start_gateway(tmp_path, limits_store="memory", reserve_tokens=3)
        servers += servers2
        streamed = await gateway2.sdk().chat.completions.create(
            model=LLM, messages=USER, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
        assert gateway2.generation.requests[-1].stopping.max_new_tokens == 3
        assert text == "Hello, world"
    finally:
        await stop(servers)


async def test_the_token_budget_is_spent_and_mesh_refusals_are_given_back(tmp_path, store):
    gateway, servers = await start_gateway(
        tmp_path, tenants={"acme": {"token_budget": 12}}, limits_store=store
    )
    try:
        # 24 characters + 4: reserves 10, refused by the mesh, so all of it comes back.
        refused_by_mesh = await chat(
            gateway,
            max_tokens=4,
            messages=[{"role": "user", "content": "refuse:INVALID_ARGUMENT"}],
        )
        assert refused_by_mesh.status_code == 400
        # Each reserves 2 + 4 = 6 and spends 6: 12 in all.
        assert (await chat(gateway, max_tokens=4)).status_code == 200
        assert (await chat(gateway, max_tokens=4)).status_code == 200
        with pytest.raises(openai.RateLimitError) as spent:
            await gateway.sdk().chat.completions.create(model=LLM, messages=USER, max_tokens=1)
        assert spent.value.code == "insufficient_quota"
        assert "retry-after" not in spent.value.response.headers
        assert len(gateway.generation.requests) == 3
    finally:
        await stop(servers)


async def test_two_gateways_on_one_redis_share_every_quota_and_the_ledger(tmp_path, redis_url):
    tenants = {
        "acme": {"requests_per_minute": 2},
        "embedco": {"token_budget": 6},
    }
    keys = {**ADMIN_KEYS, "sk-budget": ("embedco", ["generate", "embed"])}
    one, servers = await start_gateway(tmp_path, keys=keys, tenants=tenants, limits_store=redis_url)
    try:
        two, more = await start_gateway(tmp_path, limits_store=redis_url)
        servers += more
        assert (await chat(one)).status_code == 200
        assert (await chat(two)).status_code == 200
        for gateway in (one, two):  # spent through both, refused on both
            refused = await chat(gateway)
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 20  # 1 request per 30 s
        assert (await chat(one, "sk-budget", max_tokens=4)).status_code == 200
        spent = await chat(two, "sk-budget", max_tokens=1)
        assert (spent.status_code, spent.json()["error"]["code"]) == (429, "insufficient_quota")

        # One ledger: an admin reads every tenant's usage through either gateway.
        async with two.http("sk-admin") as admin:
            ledger = (await admin.get("/v1/usage")).json()["data"]
        assert ledger == [
            {
                "tenant": "acme",
                "model": LLM,
                "requests": 2,
                "prompt_tokens": 4,
                "completion_tokens": 8,
                "images": 0,
            },
            {
                "tenant": "embedco",
                "model": LLM,
                "requests": 1,
                "prompt_tokens": 2,
                "completion_tokens": 4,
                "images": 0,
            },
        ]
        async with one.http(KEY) as tenant:
            own = (await tenant.get("/v1/usage")).json()["data"]
        assert [row["tenant"] for row in own] == ["acme"]

        # Redis holds tenant names, never keys or their digests.
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            names = [name async for name in client.scan_iter()]
            assert names and all(name.startswith("aimesh:gateway:") for name in names)
            fields = await client.hkeys("aimesh:gateway:usage")
            stored = " ".join(names + fields)
            assert "acme" in stored and "sk-" not in stored
        finally:
            await client.aclose()
    finally:
        await stop(servers)


async def test_usage_without_an_admin_scope_is_the_callers_own(tmp_path):
    gateway, servers = await start_gateway(tmp_path, keys=ADMIN_KEYS)
    try:
        assert (await chat(gateway)).status_code == 200
        await gateway.sdk("sk-embed-only").embeddings.create(model="fake-embed", input="abc")
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
        limits_store=f"redis://127.0.0.1:{free_port()}/0",
    )
    try:
        refused = await chat(gateway)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "limits_store_unavailable"
        assert not gateway.generation.requests
        # A tenant without limits never touches the store.
        embedded = await gateway.sdk("sk-embed-only").embeddings.create(
            model="fake-embed", input="x"
        )
        assert len(embedded.data) == 1
    finally:
        await stop(servers)
