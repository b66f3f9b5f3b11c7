"""Retrieval fixtures' shared part: an embedder (the real one, or a fake at its gRPC
boundary) and a retrieval server on 127.0.0.1, the store in a folder of the test's."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest_asyncio

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.config import MeshSettings, ServiceSettings
from mesh.server import MeshServer
from tests.harness import InProcess


async def start_retrieval(
    store: Path, *, services: InProcess, rerank: str | None = None
) -> tuple[MeshServer, MeshServer]:
    """(embedder, retrieval), both started in `services`, retrieval reranking at `rerank`
    if given."""
    # Two threads: while these tests ingest, the embedder has the machine's cores to itself
    # (1000 stdlib passages embedded in 15 s instead of 26 with the default one thread).
    embedder = await services.start("embedder", MeshSettings(services={"embedder": {"threads": 2}}))
    retrieval = await services.start(
        "retrieval", retrieval_settings(embedder.server, rerank, path=str(store))
    )
    return embedder.server, retrieval.server


FAKE_DIMENSIONS = 8


class FakeEmbedder(embedder_pb2_grpc.EmbedderServiceServicer):
    """Stands in for the embedder at its gRPC boundary where a test is about retrieval
    itself: a vector from a hash of each input, at no model's cost (and no meaning)."""

    async def Embed(
        self, request: embedder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.EmbedResponse:
        vectors = []
        for text in request.inputs:
            digest = hashlib.sha256(text.encode()).digest()
            vectors.append(
                embedder_pb2.Embedding(values=[1 + b / 255 for b in digest[:FAKE_DIMENSIONS]])
            )
        return embedder_pb2.EmbedResponse(embeddings=vectors, dimensions=FAKE_DIMENSIONS)


async def serve_fake_embedder(server: MeshServer) -> FakeEmbedder:
    fake = FakeEmbedder()
    server.add_service(
        embedder_pb2_grpc.add_EmbedderServiceServicer_to_server,
        fake,
        embedder_pb2.DESCRIPTOR.services_by_name["EmbedderService"],
    )
    return fake


def retrieval_settings(
    embedder: MeshServer, rerank: str | None = None, **engine: Any
) -> MeshSettings:
    """Settings of a retrieval server whose embedder is `embedder` (and rerank `rerank`, if
    given), with [services.retrieval] `engine` (a path or a url)."""
    dependencies = {"embedder": f"127.0.0.1:{embedder.port}"}
    if rerank is not None:
        dependencies["rerank"] = rerank
    return MeshSettings(
        services={"retrieval": ServiceSettings(dependencies=dependencies, **engine)},
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fake_embedder() -> AsyncIterator[MeshServer]:
    async with InProcess() as services:
        yield (await services.start("embedder", setup=serve_fake_embedder)).server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fake_retrieval(fake_embedder, tmp_path_factory) -> AsyncIterator[MeshServer]:
    """Retrieval on embedded Qdrant in a folder of the module's, embedding with the fake."""
    settings = retrieval_settings(fake_embedder, path=str(tmp_path_factory.mktemp("qdrant")))
    async with InProcess() as services:
        yield (await services.start("retrieval", settings)).server
