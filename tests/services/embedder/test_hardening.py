"""The embedder under hostile and heavy input: refusals are INVALID_ARGUMENT naming the field,
and tokenizing large inputs leaves the event loop free (health answers meanwhile)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import pytest_asyncio

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh import request_id
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import field_violations
from mesh.failures import FieldViolation
from mesh.server import MeshServer
from services.embedder.encoder import Encoder
from services.embedder.engine import EmbedEngine
from services.embedder.servicer import (
    MAX_INPUT_BYTES,
    MAX_INPUTS,
    SERVICE,
    EmbedderServicer,
)
from tests.conftest import health_delays, target
from tests.harness import InProcess

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(mesh_settings: MeshSettings) -> AsyncIterator[MeshServer]:
    async with InProcess() as services:
        yield (await services.start("embedder", mesh_settings)).server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(
    server: MeshServer, mesh_settings: MeshSettings
) -> AsyncIterator[embedder_pb2_grpc.EmbedderServiceStub]:
    async with create_channel(target(server), mesh_settings, services=[SERVICE]) as channel:
        yield embedder_pb2_grpc.EmbedderServiceStub(channel)


async def _violations(stub, **fields) -> list[FieldViolation]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(embedder_pb2.EmbedRequest(**fields), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(caught.value)


async def test_a_request_id_that_cannot_travel(stub):
    assert await _violations(stub, request_id="é" * 3, inputs=["hello"]) == [
        FieldViolation("request_id", request_id.RULE)
    ]
    response = await stub.Embed(embedder_pb2.EmbedRequest(request_id="req-1", inputs=["hi"]))
    assert len(response.embeddings) == 1


async def test_too_many_inputs_are_refused_without_reading_each(stub):
    """100k inputs: one violation, not 16 of the first empty ones after a scan of all."""
    assert await _violations(stub, inputs=[""] * 100_000) == [
        FieldViolation("inputs", f"must hold at most {MAX_INPUTS} texts, got 100000")
    ]


async def test_tokenizing_many_bytes_never_runs_on_the_event_loop(
    onnx_encoder: Encoder, monkeypatch
):
    """32 inputs of 200 emoji: 6,400 characters but 25.6 KB, ~10 ms of tokenizing."""
    threads: set[int] = set()
    tokenize = onnx_encoder.tokenizer.tokenize

    def recorded(*args, **kwargs):
        threads.add(threading.get_ident())
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(onnx_encoder.tokenizer, "tokenize", recorded)
    servicer = EmbedderServicer()
    with ThreadPoolExecutor(1) as model_thread:
        servicer.engine = EmbedEngine(onnx_encoder, 64, max_wait_s=0.002, model_thread=model_thread)
        servicer.engine.start()
        try:
            request = embedder_pb2.EmbedRequest(inputs=["🙂" * 200] * MAX_INPUTS, truncate=True)
            response = await servicer.Embed(request, None)
        finally:
            await servicer.engine.close()
    assert len(response.embeddings) == MAX_INPUTS
    assert threads and threading.get_ident() not in threads


@pytest.mark.system  # 5-7 s of the largest request: in the full run, not make test-fast
async def test_health_answers_while_the_largest_request_runs(stub, server):
    """32 inputs of 64 KiB, cut to 256 tokens: 2 MiB to tokenize, 32 full passes."""
    unit = "naïve café 日本語 🙂 "
    text = unit * (MAX_INPUT_BYTES // len(unit.encode()))
    inputs = [text[index:] + text[:index] for index in range(MAX_INPUTS)]
    request = embedder_pb2.EmbedRequest(inputs=inputs, truncate=True)
    embedding = asyncio.ensure_future(stub.Embed(request, timeout=120))
    done = threading.Event()
    embedding.add_done_callback(lambda _: done.set())
    delays = await asyncio.to_thread(health_delays, server.port, done, "embedder")
    response = await embedding
    assert len(response.embeddings) == MAX_INPUTS
    assert response.usage.prompt_tokens == 256 * MAX_INPUTS
    assert len(delays) >= 5  # the checks overlapped the work
    assert max(delays) < 1.0
