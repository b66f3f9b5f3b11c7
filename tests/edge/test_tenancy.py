"""One meter behind every door of `aimesh up --edge`: the gateway's HTTP API and the edge's
gRPC and JSON routes charge a tenant's one requests bucket and one token budget (the
generation router meters every generation, whichever door it came in by), and the ledger
the gateway serves holds what both doors' responses said they used."""

from __future__ import annotations

import grpc
import httpx
import pytest

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from services.llm.artifacts import DEFAULT_NAME
from tests.conftest import eventually
from tests.edge.conftest import FRUGAL_BUDGET, Edge
from tests.edge.test_keys import auth, code_of
from tests.services.llm.conftest import collected

pytestmark = pytest.mark.system

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def http(edge: Edge, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=edge.url, headers={"authorization": f"Bearer {key}"}, timeout=120
    )


async def test_requests_per_minute_is_one_bucket_across_the_gateway_and_the_edge(edge: Edge):
    """paced may send one request per window: spent through the gateway's HTTP API, the
    edge's gRPC route has nothing left for it (two buckets used to serve it twice)."""
    async with http(edge, "sk-paced") as client:
        served = await client.post(
            "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hello"}
        )
    assert served.status_code == 200, served.text
    async with grpc.aio.insecure_channel(edge.target) as channel:
        embed = embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
            embedder_pb2.EmbedRequest(inputs=["hi"]), metadata=auth("sk-paced"), timeout=30
        )
        assert await code_of(embed) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_budget_spent_through_the_gateway_is_spent_at_the_edge(edge: Edge):
    """frugal spends part of its budget on a chat completion through the gateway, two
    choices of one prompt (billed once: one prefill computed it); the edge's JSON
    /v1/generate asking for more than is left is refused (it used to be served whatever
    the gateway had counted), a request that fits is served, and the ledger is the sum
    of the usage both doors reported."""
    async with http(edge, "sk-frugal") as client:
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": DEFAULT_NAME,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8,
                "n": 2,
            },
        )
        assert chat.status_code == 200, chat.text
        usage = chat.json()["usage"]
        spent = usage["total_tokens"]
        assert spent == usage["prompt_tokens"] + usage["completion_tokens"]
        left = FRUGAL_BUDGET - spent
        assert left > 10
        too_much = await client.post(
            "/v1/generate", json={"prompt": "Hello", "stopping": {"max_new_tokens": left}}
        )
    assert too_much.status_code == 429, too_much.text
    assert "token budget" in too_much.text
    async with grpc.aio.insecure_channel(edge.target) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            generation_pb2.GenerateRequest(
                prompt="Hello", stopping=sampling_pb2.StoppingCriteria(max_new_tokens=2)
            ),
            metadata=auth("sk-frugal"),
            timeout=120,
        )
        complete = (await collected(call))[2]
    assert complete.usage.total_tokens <= left

    rows: list[dict] = []

    async def both_recorded() -> bool:
        async with http(edge, "sk-admin") as admin:
            rows[:] = [r for r in (await admin.get("/v1/usage")).json()["data"]]
        return sum(row["requests"] for row in rows if row["tenant"] == "frugal") == 2

    await eventually(both_recorded, timeout_s=30, interval_s=0.2)
    used = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows if r["tenant"] == "frugal")
    assert used == spent + complete.usage.total_tokens
