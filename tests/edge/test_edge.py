"""Through the real Envoy: gRPC, JSON and gRPC-Web reach the services, only with a key,
reflection stays inside, and one trace runs from the caller through Envoy into the mesh."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import struct

import grpc
import httpx
import pytest

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from tests.conftest import VENV_BIN, eventually, spans_of
from tests.edge.conftest import API_KEY, BROWSER_ORIGIN

pytestmark = pytest.mark.system

AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPT = "The capital of France is"


def greedy(max_new_tokens: int = 8) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=PROMPT,
        sampling=sampling_pb2.SamplingParameters(temperature=0),
        stopping=sampling_pb2.StoppingCriteria(max_new_tokens=max_new_tokens),
    )


async def generate(target: str, metadata=AUTH) -> list[generation_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return [r async for r in stub.Generate(greedy(), metadata=metadata, timeout=60)]


def text_of(responses: list[generation_pb2.GenerateResponse]) -> str:
    return "".join(r.chunk.text for r in responses if r.HasField("chunk"))


async def test_streamed_generate_over_grpc_through_envoy_matches_the_direct_call(edge):
    through_edge = await generate(edge.target)
    direct = await generate(f"127.0.0.1:{edge.ports['generation']}", metadata=())
    chunks = [r for r in through_edge if r.HasField("chunk")]
    assert len(chunks) >= 2, "a stream, not one buffered reply"
    assert through_edge[-1].HasField("complete")
    assert through_edge[-1].complete.usage.completion_tokens == 8
    assert text_of(through_edge) == text_of(direct) and text_of(direct).strip()


async def test_the_same_stream_as_json_is_an_array_of_messages(edge):
    body = {"prompt": PROMPT, "sampling": {"temperature": 0}, "stopping": {"maxNewTokens": 8}}
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        reply = await client.post(
            "/v1/generate", json=body, headers={"authorization": f"Bearer {API_KEY}"}
        )
    assert reply.status_code == 200, reply.text
    messages = reply.json()
    assert isinstance(messages, list) and len(messages) >= 3
    assert messages[-1]["complete"]["finishReason"] == "FINISH_REASON_LENGTH"
    text = "".join(m["chunk"]["text"] for m in messages if "chunk" in m)
    assert text == text_of(await generate(edge.target))


async def test_json_errors_carry_the_field_violations(edge):
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        reply = await client.post(
            "/v1/embed", json={"inputs": [""]}, headers={"x-api-key": API_KEY}
        )
    assert reply.status_code == 400
    status = reply.json()
    assert status["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    violations = [d for d in status["details"] if d["@type"].endswith("BadRequest")]
    assert violations[0]["fieldViolations"][0]["field"] == "inputs[0]"


def grpc_web_frame(message: bytes) -> bytes:
    return struct.pack(">BI", 0, len(message)) + message


def grpc_web_frames(body: bytes) -> tuple[list[bytes], dict[str, str]]:
    """The data frames and the trailers of a gRPC-Web response body."""
    messages, trailers = [], {}
    while body:
        flag, length = struct.unpack(">BI", body[:5])
        payload, body = body[5 : 5 + length], body[5 + length :]
        if flag & 0x80:
            for line in payload.decode().strip().split("\r\n"):
                key, _, value = line.partition(":")
                trailers[key.strip().lower()] = value.strip()
        else:
            messages.append(payload)
    return messages, trailers


async def test_grpc_web_from_a_browser_origin(edge):
    origin = BROWSER_ORIGIN
    path = "/aimesh.retrieval.v1.EmbedderService/Embed"
    request = embedder_pb2.EmbedRequest(inputs=["a cat sat on the mat"])
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        preflight = await client.options(
            path,
            headers={
                "origin": origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type,x-grpc-web,authorization",
            },
        )
        reply = await client.post(
            path,
            content=grpc_web_frame(request.SerializeToString()),
            headers={
                "origin": origin,
                "content-type": "application/grpc-web+proto",
                "x-grpc-web": "1",
                "authorization": f"Bearer {API_KEY}",
            },
        )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == origin
    assert reply.status_code == 200
    assert "grpc-status" in reply.headers["access-control-expose-headers"]
    messages, trailers = grpc_web_frames(reply.content)
    assert trailers["grpc-status"] == "0"
    (web,) = [embedder_pb2.EmbedResponse.FromString(m) for m in messages]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{edge.ports['embedder']}") as channel:
        direct = await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(request, timeout=30)
    assert list(web.embeddings[0].values) == pytest.approx(list(direct.embeddings[0].values))


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-key"),)])
async def test_a_call_without_a_valid_key_is_refused(edge, metadata):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(edge.target, metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        reply = await client.post("/v1/embed", json={"inputs": ["hi"]}, headers=dict(metadata))
    assert reply.status_code == 401


async def test_reflection_and_internal_services_stay_inside(edge):
    listing = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "grpcurl"), "-plaintext", "-H", f"authorization: Bearer {API_KEY}",
        edge.target, "list",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await listing.communicate()
    assert listing.returncode != 0 and b"reflection" in out
    async with grpc.aio.insecure_channel(edge.target) as channel:
        load = channel.unary_unary("/aimesh.llm.v1.DecodeService/GetLoad")
        with pytest.raises(grpc.aio.AioRpcError) as hidden:
            await load(b"", metadata=AUTH, timeout=10)
    # No edge key has a scope for a method the edge does not serve (the route would 404).
    assert hidden.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_an_incoming_traceparent_continues_through_envoy_into_the_mesh(edge):
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (*AUTH, ("traceparent", f"00-{trace_id}-{caller_span}-01"))
    await generate(edge.target, metadata=metadata)
    expected = {"aimesh-edge", "aimesh-generation", "aimesh-tokenizer", "aimesh-prefill",
                "aimesh-decode"}  # fmt: skip
    spans: list[dict[str, str]] = []

    def router_under_envoy() -> list[dict[str, str]]:
        edge_ids = {span["ID"] for span in spans if span["service"] == "aimesh-edge"}
        return [
            span
            for span in spans
            if span["service"] == "aimesh-generation" and span.get("Parent ID") in edge_ids
        ]

    def complete() -> bool:
        # Every service's spans, and Envoy's upstream span too: Envoy exports its spans in
        # batches of its own, so its ingress span can arrive before the one the router's
        # span is a child of.
        spans[:] = spans_of(edge.spans.read_text(), trace_id)
        return expected <= {span["service"] for span in spans} and bool(router_under_envoy())

    try:
        await eventually(complete, timeout_s=30, interval_s=0.5)
    except AssertionError:
        raise AssertionError(
            f"trace {trace_id}: no generation span under Envoy's, or a service missing: {spans}"
        ) from None
    roots = [span for span in spans if span.get("Parent ID") == caller_span]
    assert roots and all(span["service"] == "aimesh-edge" for span in roots)


async def test_envoy_exports_prometheus_stats_per_grpc_method(edge):
    await generate(edge.target)
    async with httpx.AsyncClient(timeout=10) as client:
        reply = await client.get(f"http://127.0.0.1:{edge.metrics_port}/stats/prometheus")
    assert reply.status_code == 200
    # Envoy's default tag rules split dotted service names; the method is in the name.
    assert re.search(r"^envoy_cluster_grpc_\w*GenerationService_Generate_success", reply.text, re.M)
    access = [json.loads(line) for line in edge.access_log.read_text().splitlines()
              if line.startswith("{")]  # fmt: skip
    generated = [a for a in access if a["grpc_path"].endswith("GenerationService/Generate")]
    assert any(a["client"] == "key-1" and a["grpc_status"] == 0 for a in generated)
