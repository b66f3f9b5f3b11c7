"""Scoped edge keys on the real Envoy and its authorizer (mesh/edge/authorizer.py): a
key file of digests shared with the gateway, a scope per method, the tenant carried to
the services, rotation without a restart."""

from __future__ import annotations

import secrets

import grpc
import httpx
import pytest

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.retrieval.v1 import (
    embedder_pb2,
    embedder_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from tests.edge.conftest import GATEWAY_KEYS, TENANT_LIMITS, Edge, embed_as_logged
from tests.services.gateway.conftest import write_keys

pytestmark = pytest.mark.system


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def code_of(call) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):  # a server stream
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_a_keys_scopes_decide_which_methods_it_may_call(edge: Edge):
    """sk-reader (read, embed) embeds but may not generate or write; sk-writer (read,
    write) gets past the key check on Upsert and Delete (no retrieval runs behind this
    edge, so the route answers next); no key, or an unknown one, is UNAUTHENTICATED."""
    generate = generation_pb2.GenerateRequest(
        prompt="Hello",
        sampling=sampling_pb2.SamplingParameters(temperature=0),
        stopping=sampling_pb2.StoppingCriteria(max_new_tokens=2),
    )
    delete = retrieval_pb2.DeleteRequest(collection="knowledge", ids=["x"])
    async with grpc.aio.insecure_channel(edge.target) as channel:
        embedder = embedder_pb2_grpc.EmbedderServiceStub(channel)
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        retrieval = retrieval_pb2_grpc.RetrievalServiceStub(channel)

        def embed(key: str):
            request = embedder_pb2.EmbedRequest(inputs=["hi"])
            return embedder.Embed(request, metadata=auth(key), timeout=30)

        assert await code_of(embed("sk-reader")) == grpc.StatusCode.OK
        assert await code_of(embed("sk-writer")) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(embed("sk-bogus")) == grpc.StatusCode.UNAUTHENTICATED
        unkeyed = embedder.Embed(embedder_pb2.EmbedRequest(inputs=["hi"]), timeout=30)
        assert await code_of(unkeyed) == grpc.StatusCode.UNAUTHENTICATED
        denied = generation.Generate(generate, metadata=auth("sk-reader"), timeout=30)
        assert await code_of(denied) == grpc.StatusCode.PERMISSION_DENIED
        for key, expected in (
            ("sk-reader", grpc.StatusCode.PERMISSION_DENIED),
            ("sk-writer", grpc.StatusCode.UNIMPLEMENTED),
        ):
            call = retrieval.Delete(delete, metadata=auth(key), timeout=30)
            assert await code_of(call) == expected, key
    # JSON through the transcoder is checked as the method it becomes: 403 and 401 bodies.
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        forbidden = await client.post(
            "/v1/generate",
            headers={"authorization": "Bearer sk-reader"},
            json={"prompt": "Hello", "stopping": {"maxNewTokens": 2}},
        )
        unknown = await client.post("/v1/embed", headers={"x-api-key": "nope"}, json={})
    assert forbidden.status_code == 403 and "generate" in forbidden.text
    assert unknown.status_code == 401


async def test_the_keys_tenant_reaches_the_services_and_the_key_does_not(edge: Edge):
    """The service sees x-aimesh-client = the key's tenant (as logged by Envoy after the
    check), whatever the client claimed; the key itself is gone from the request."""
    line = await embed_as_logged(
        edge, {"authorization": "Bearer sk-reader", "x-aimesh-client": "acme"}
    )
    assert line["client"] == "reader"
    assert "sk-reader" not in edge.access_log.read_text()


async def test_a_key_added_to_the_file_works_and_a_removed_one_stops_without_a_restart(
    edge: Edge,
):
    fresh = f"sk-{secrets.token_hex(8)}"
    request = embedder_pb2.EmbedRequest(inputs=["hi"])
    try:
        async with grpc.aio.insecure_channel(edge.target) as channel:
            embedder = embedder_pb2_grpc.EmbedderServiceStub(channel)
            call = embedder.Embed(request, metadata=auth(fresh), timeout=30)
            assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
            write_keys(edge.keys, {**GATEWAY_KEYS, fresh: ("fresh", ["embed"])}, TENANT_LIMITS)
            call = embedder.Embed(request, metadata=auth(fresh), timeout=30)
            assert await code_of(call) == grpc.StatusCode.OK
            write_keys(edge.keys, GATEWAY_KEYS, TENANT_LIMITS)
            call = embedder.Embed(request, metadata=auth(fresh), timeout=30)
            assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        write_keys(edge.keys, GATEWAY_KEYS, TENANT_LIMITS)


async def test_a_tenant_past_its_requests_per_minute_is_held_back_at_the_edge(edge: Edge):
    """sk-tiny's tenant may send one request a minute (the same [tenants.tiny] limit the
    gateway applies): the next gRPC call is RESOURCE_EXHAUSTED, backpressure rather than a
    sick server, and JSON gets 429 with retry-after."""
    request = embedder_pb2.EmbedRequest(inputs=["hi"])
    async with grpc.aio.insecure_channel(edge.target) as channel:
        embedder = embedder_pb2_grpc.EmbedderServiceStub(channel)
        # One after the other: a grpc.aio call starts when it is made, so two made at
        # once race for the tenant's one token.
        first = await code_of(embedder.Embed(request, metadata=auth("sk-tiny"), timeout=30))
        second = await code_of(embedder.Embed(request, metadata=auth("sk-tiny"), timeout=30))
        assert (first, second) == (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)
        other = embedder.Embed(request, metadata=auth("sk-reader"), timeout=30)
        assert await code_of(other) == grpc.StatusCode.OK
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        held = await client.post(
            "/v1/embed", headers={"authorization": "Bearer sk-tiny"}, json={"inputs": ["x"]}
        )
    assert held.status_code == 429 and int(held.headers["retry-after"]) > 0
