"""Readiness follows the warm-up: SERVING only once the model is loaded and has embedded."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import error_info
from mesh.health import probe, wait_until_serving
from mesh.server import MeshServer
from services.embedder.servicer import SERVICE, setup
from tests.conftest import eventually, target
from tests.harness import InProcess
from tests.services.embedder.conftest import CACHE_DIR

pytestmark = pytest.mark.service


async def test_serving_only_after_the_warm_up(mesh_settings: MeshSettings):
    gate = asyncio.Event()
    set_up: list[MeshServer] = []

    async def gated(server: MeshServer) -> None:
        set_up.append(server)
        server.add_warmup(gate.wait)  # runs first, so the model cannot load until the gate opens
        await setup(server)

    services = InProcess()
    starting = asyncio.create_task(services.start("embedder", mesh_settings, setup=gated))
    try:
        await eventually(lambda: bool(set_up) and set_up[0].port != 0)
        (server,) = set_up
        channel = services.channel(target(server), SERVICE, settings=mesh_settings)
        stub = embedder_pb2_grpc.EmbedderServiceStub(channel)
        request = embedder_pb2.EmbedRequest(inputs=["hello world"])
        assert await wait_until_serving(target(server), "", timeout_s=5)  # alive
        for name in server.readiness_names:
            assert await probe(target(server), name) == "NOT_SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(request, timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(caught.value).reason == "NOT_READY"

        gate.set()
        await asyncio.wait_for(starting, timeout=60)
        for name in server.readiness_names:
            assert await probe(target(server), name) == "SERVING"
        response = await stub.Embed(request, timeout=5)
        assert len(response.embeddings[0].values) == 384
    finally:
        starting.cancel()
        await services.close()


# `aimesh serve` processes, seconds each: the system tier keeps make test-fast under 3 min.
@pytest.mark.system
async def test_aimesh_serve_embedder_on_each_backend(serve_process, monkeypatch):
    """The path `aimesh up` and Kubernetes take: the entry point, the CLI, the warm-up."""
    monkeypatch.setenv("AIMESH_CACHE_DIR", str(CACHE_DIR))
    vectors = {}
    for backend in ("onnx", "torch"):
        monkeypatch.setenv("AIMESH_SERVICES__EMBEDDER__BACKEND", backend)
        child = await serve_process("embedder")
        async with create_channel(child.target, MeshSettings(), services=[SERVICE]) as channel:
            stub = embedder_pb2_grpc.EmbedderServiceStub(channel)
            response = await stub.Embed(embedder_pb2.EmbedRequest(inputs=["hello world"]))
        vectors[backend] = list(response.embeddings[0].values)
        child.signal(signal.SIGTERM)
        await child.wait()
    assert vectors["onnx"] == pytest.approx(vectors["torch"], abs=1e-5)
