"""Property: whatever a caller sends, and whenever it cancels, rerank answers OK or
INVALID_ARGUMENT naming a field (CANCELLED for a cancelled call), never INTERNAL or UNKNOWN
or a hang, and it ranks a normal request right after.

Requests go over real gRPC to one rerank server (the embedded scorer) in this process.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from mesh.errors import field_violations
from services.rerank.servicer import SERVICE
from tests.harness import InProcess
from tests.strategies import mostly
from tests.strategies import wild_strings as wild_strings_of

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


WORDS = ("", " ", "\x00", "\x1b[31m", "\u200b\u202e", "\ufffd", "[CLS]", "[SEP] [PAD]", "é")
wild_strings = wild_strings_of(WORDS, [257, 9000, 70_000, 300_000])
sane_documents = st.builds(
    rerank_pb2.Document, id=st.text(max_size=8), text=st.text(min_size=1, max_size=300)
)
documents = mostly(
    st.lists(sane_documents, min_size=1, max_size=6),
    st.one_of(
        st.lists(st.builds(rerank_pb2.Document, id=wild_strings, text=wild_strings), max_size=6),
        # Duplicate ids, or more documents than allowed.
        st.sampled_from([100, 1001, 10_000]).map(
            lambda n: [rerank_pb2.Document(id="same", text="a document")] * n
        ),
    ),
)
requests = st.builds(
    rerank_pb2.RerankRequest,
    request_id=mostly(st.sampled_from(["", "req-1"]), wild_strings),
    query=mostly(st.text(min_size=1, max_size=60), wild_strings),
    documents=documents,
    top_n=mostly(st.integers(0, 8), st.integers(-(2**31), 2**31 - 1)),
    truncate=st.booleans(),
    return_text=st.booleans(),
    raw_scores=st.booleans(),
    return_documents=st.booleans(),
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub() -> AsyncIterator[rerank_pb2_grpc.RerankServiceStub]:
    async with InProcess() as services:
        served = await services.start("rerank")
        yield rerank_pb2_grpc.RerankServiceStub(services.channel(served.target, SERVICE))


@settings(
    deadline=None,
    max_examples=80,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests, cancel_after_s=st.sampled_from([None, None, 0.0, 0.002, 0.02]))
async def test_rerank_gets_the_callers_answer(stub, request, cancel_after_s):
    call = stub.Rerank(request, timeout=120)
    if cancel_after_s is not None:
        await asyncio.sleep(cancel_after_s)
        call.cancel()
    try:
        response = await call
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
        scores = [result.score for result in response.results]
        assert all(math.isfinite(score) for score in scores)
        assert scores == sorted(scores, reverse=True)
        expected = len(request.documents)
        assert len(scores) == (min(expected, request.top_n) if request.top_n else expected)
    normal = await stub.Rerank(
        rerank_pb2.RerankRequest(query="q", documents=[rerank_pb2.Document(text="d")]),
        timeout=60,
    )
    assert len(normal.results) == 1
