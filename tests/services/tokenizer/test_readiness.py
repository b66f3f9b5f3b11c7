"""Readiness follows the warm-up: the tokenizer is SERVING only once its engine is loaded."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import error_info
from mesh.health import probe, wait_until_serving
from mesh.server import MeshServer
from services.tokenizer.servicer import SERVICE, setup
from tests.conftest import eventually, target
from tests.harness import InProcess
from tests.services.tokenizer.conftest import CACHE_DIR

pytestmark = pytest.mark.service


async def test_serving_only_after_the_warm_up(mesh_settings: MeshSettings):
    gate = asyncio.Event()
    set_up: list[MeshServer] = []

    async def gated(server: MeshServer) -> None:
        set_up.append(server)
        server.add_warmup(gate.wait)  # runs first, so the engine cannot load until the gate opens
        await setup(server)

    services = InProcess()
    starting = asyncio.create_task(services.start("tokenizer", mesh_settings, setup=gated))
    try:
        await eventually(lambda: bool(set_up) and set_up[0].port != 0)
        (server,) = set_up
        channel = services.channel(target(server), SERVICE, settings=mesh_settings)
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        assert await wait_until_serving(target(server), "", timeout_s=5)  # alive
        for name in server.readiness_names:
            assert await probe(target(server), name) == "NOT_SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(caught.value).reason == "NOT_READY"

        gate.set()
        await asyncio.wait_for(starting, timeout=30)
        for name in server.readiness_names:
            assert await probe(target(server), name) == "SERVING"
        response = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), timeout=5)
        assert response.token_ids
    finally:
        starting.cancel()
        await services.close()


# `aimesh serve` processes, seconds each: the system tier keeps make test-fast under 3 min.
@pytest.mark.system
async def test_aimesh_serve_tokenizer(serve_process, monkeypatch):
    """The path `aimesh up` and Kubernetes take: the entry point, the CLI, the warm-up."""
    monkeypatch.setenv("AIMESH_CACHE_DIR", str(CACHE_DIR))
    child = await serve_process("tokenizer")
    channel = create_channel(child.target, MeshSettings(), services=[SERVICE])
    async with channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        response = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hello world"))
    assert list(response.token_ids) == [28120, 905]
