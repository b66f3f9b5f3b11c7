"""The embedder with its model on a real Triton server: same vectors as in process, and
Triton's outages surface as the mesh's own UNAVAILABLE, open breaker and readiness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.errors import error_info
from mesh.health import probe, wait_until_serving
from services.embedder.encoder import Encoder
from services.embedder.settings import EmbedderSettings
from tests.conftest import VENV_BIN, free_port, subprocess_env
from tests.services.embedder.conftest import CACHE_DIR, TEXTS
from tests.triton.conftest import until

pytestmark = pytest.mark.system

BREAKER_CALLS = 4


@pytest_asyncio.fixture(loop_scope="package")
async def embedder(triton, tmp_path) -> AsyncIterator[str]:
    """`aimesh serve embedder` whose backend is Triton; a small breaker window."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "serve", "embedder",
        env=subprocess_env(
            AIMESH_SERVICES__EMBEDDER__PORT=str(port),
            AIMESH_SERVICES__EMBEDDER__METRICS_PORT="0",
            AIMESH_SERVICES__EMBEDDER__BACKEND="triton",
            AIMESH_SERVICES__EMBEDDER__TRITON__URL=triton.url,
            AIMESH_SERVICES__EMBEDDER__TRITON__MODEL="sentence_embedding",
            AIMESH_CLIENT__BREAKER__WINDOW_SIZE=str(BREAKER_CALLS),
            AIMESH_CLIENT__BREAKER__MINIMUM_CALLS=str(BREAKER_CALLS),
            AIMESH_CLIENT__BREAKER__OPEN_WAIT_S="1",
        ),
        stderr=(tmp_path / "embedder.log").open("wb"),
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        ready = await wait_until_serving(target, "embedder", timeout_s=120)
        assert ready, (tmp_path / "embedder.log").read_text()[-3000:]
        yield target
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def embed(target: str, texts: list[str]) -> embedder_pb2.EmbedResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = embedder_pb2_grpc.EmbedderServiceStub(channel)
        return await stub.Embed(embedder_pb2.EmbedRequest(inputs=texts, truncate=True), timeout=30)


async def test_vectors_through_triton_equal_the_in_process_ones(embedder):
    reply = await embed(embedder, TEXTS)
    served = np.array([list(e.values) for e in reply.embeddings], dtype=np.float32)
    local, _ = Encoder.load(EmbedderSettings(backend="onnx"), CACHE_DIR).encode(TEXTS)
    cosines = (served * local).sum(axis=1) / (
        np.linalg.norm(served, axis=1) * np.linalg.norm(local, axis=1)
    )
    assert served.shape == local.shape
    assert np.all(cosines > 1 - 1e-4), cosines


async def test_triton_down_is_unavailable_at_once_opens_the_breaker_and_recovers(embedder, triton):
    await embed(embedder, ["warm"])
    triton.stop()
    reasons = []
    for _ in range(BREAKER_CALLS + 1):
        started = time.monotonic()
        try:
            await embed(embedder, ["while Triton is down"])
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 5, "promptly, not after a timeout"
            reasons.append(error_info(error).reason)
    assert reasons[0] == "TRITON_UNAVAILABLE"
    assert reasons[-1] == "CIRCUIT_OPEN"

    async def not_ready() -> bool:
        return await probe(embedder, "embedder") == "NOT_SERVING"

    await until(not_ready, timeout_s=10)
    assert await probe(embedder, "") == "SERVING", "alive all along"

    triton.start()
    await triton.wait_all_ready()
    assert await wait_until_serving(embedder, "embedder", timeout_s=30)

    async def serves() -> bool:
        try:
            return len((await embed(embedder, ["back"])).embeddings) == 1
        except grpc.aio.AioRpcError:
            return False

    await until(serves, timeout_s=15)
