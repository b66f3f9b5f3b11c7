"""The edge against what a hostile client sends, on the real Envoy (docs/security.md):
forged forwarding and identity headers, Envoy's own control headers, oversized bodies,
underscored headers and foreign browser origins."""

from __future__ import annotations

import grpc
import httpx
import pytest

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from tests.edge.conftest import API_KEY, Edge, embed_as_logged

pytestmark = pytest.mark.system

AUTH = {"authorization": f"Bearer {API_KEY}"}
TOO_BIG = 2 * 1024 * 1024  # past edge.max_request_bytes (1 MiB)


async def test_forged_forwarding_and_client_headers_are_not_believed(edge: Edge):
    """x-forwarded-for cannot make a client someone else (edge.trusted_hops is 0), and
    x-aimesh-client, which the services scope data by, is the key's, never the client's."""
    line = await embed_as_logged(
        edge, {**AUTH, "x-forwarded-for": "6.6.6.6", "x-aimesh-client": "victim"}
    )
    assert line["remote"] == "127.0.0.1" and line["client"] == "key-1"


async def test_envoys_control_headers_from_a_client_are_stripped(edge: Edge):
    """A 1 ms upstream timeout, were it honoured, would fail every generation with 504;
    no client address counts as internal, loopback included."""
    request = generation_pb2.GenerateRequest(
        prompt="The capital of France is",
        sampling=sampling_pb2.SamplingParameters(temperature=0),
        stopping=sampling_pb2.StoppingCriteria(max_new_tokens=4),
    )
    metadata = (
        ("authorization", f"Bearer {API_KEY}"),
        ("x-envoy-upstream-rq-timeout-ms", "1"),
        ("x-envoy-max-retries", "100"),
    )
    async with grpc.aio.insecure_channel(edge.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        replies = [r async for r in stub.Generate(request, metadata=metadata, timeout=120)]
    assert replies[-1].HasField("complete")


async def test_a_body_past_the_routes_limit_is_refused_at_the_edge_with_413(edge: Edge):
    """JSON to a transcoded route, the OpenAI API and gRPC alike: refused before any of
    it reaches a service; the same route still serves a body under the limit."""
    big = "x" * TOO_BIG
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        embed = await client.post("/v1/embed", headers=AUTH, json={"inputs": [big]})
        openai = await client.post(
            "/v1/embeddings",
            headers={"authorization": "Bearer sk-everything"},
            json={"model": "sentence-transformers/all-MiniLM-L6-v2", "input": big},
        )
        small = await client.post("/v1/embed", headers=AUTH, json={"inputs": ["hello"]})
    assert embed.status_code == 413, embed.text[:300]
    assert openai.status_code == 413, openai.text[:300]
    assert small.status_code == 200
    request = generation_pb2.GenerateRequest(prompt=big)
    async with grpc.aio.insecure_channel(edge.target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(request, metadata=tuple(AUTH.items()), timeout=60):
                pass
    # Envoy's 413 reaches a gRPC client as its local reply's status and message.
    assert "Payload Too Large" in (refused.value.details() or ""), refused.value


async def test_underscored_headers_and_foreign_origins_get_nothing(edge: Edge):
    """x_api_key and x-api-key are one header to some servers behind a proxy: refused.
    A browser on an origin not in edge.cors_allow_origins gets no CORS grant."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        underscored = await client.post(
            "/v1/embed", headers={**AUTH, "x_api_key": "x"}, json={"inputs": ["hi"]}
        )
        preflight = await client.options(
            "/v1/embed",
            headers={
                "origin": "https://attacker.example",
                "access-control-request-method": "POST",
            },
        )
    assert underscored.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
