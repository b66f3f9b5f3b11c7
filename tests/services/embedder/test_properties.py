"""Property: whatever a caller sends, and whenever it cancels, the embedder answers OK or
INVALID_ARGUMENT naming a field (CANCELLED for a cancelled call), never INTERNAL or UNKNOWN
or a hang, and it embeds a normal request right after.

Requests go over real gRPC to one embedder server (ONNX Runtime) in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.config import MeshSettings
from mesh.errors import field_violations
from services.embedder.servicer import SERVICE
from tests.harness import InProcess
from tests.strategies import mostly
from tests.strategies import wild_strings as wild_strings_of

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


WORDS = ("", " ", "\x00", "\x1b[31m", "\u200b\u202e", "\ufffd", "[CLS]", "[SEP] [PAD]", "é")
wild_strings = wild_strings_of(WORDS, [257, 9000, 70_000, 300_000])
inputs = mostly(
    st.lists(st.text(min_size=1, max_size=200), min_size=1, max_size=4),
    st.one_of(
        st.lists(wild_strings, max_size=6),
        st.sampled_from([33, 100_000]).map(lambda n: ["text"] * n),
    ),
)
requests = st.builds(
    embedder_pb2.EmbedRequest,
    request_id=mostly(st.sampled_from(["", "req-1"]), wild_strings),
    inputs=inputs,
    normalize=st.one_of(st.none(), st.booleans()),
    truncate=st.booleans(),
    truncation_direction=mostly(st.integers(0, 2), st.integers(-(2**31), 2**31 - 1)),
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(mesh_settings: MeshSettings) -> AsyncIterator[embedder_pb2_grpc.EmbedderServiceStub]:
    async with InProcess() as services:
        served = await services.start("embedder", mesh_settings)
        channel = services.channel(served.target, SERVICE, settings=mesh_settings)
        yield embedder_pb2_grpc.EmbedderServiceStub(channel)


@settings(
    deadline=None,
    max_examples=80,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests, cancel_after_s=st.sampled_from([None, None, 0.0, 0.002, 0.02]))
async def test_embed_gets_the_callers_answer(stub, request, cancel_after_s):
    call = stub.Embed(request, timeout=60)
    if cancel_after_s is not None:
        await asyncio.sleep(cancel_after_s)
        call.cancel()
    try:
        await call
    except asyncio.CancelledError:
        assert cancel_after_s is not None
        event("CANCELLED")
    except grpc.aio.AioRpcError as error:
        event(error.code().name)
        assert error.code() in ANSWERS
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert field_violations(error), "a refusal must name the field"
    else:
        event("OK")
    normal = await stub.Embed(embedder_pb2.EmbedRequest(inputs=["hello world"]), timeout=30)
    assert len(normal.embeddings[0].values) == 384
