"""Rerank under hostile and heavy input: refusals are INVALID_ARGUMENT naming the field, a
large request is scored in groups that stop when its caller goes and let other requests
through, and health answers while the largest one runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import pytest_asyncio

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from mesh import request_id
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import field_violations
from mesh.failures import FieldViolation
from mesh.server import MeshServer
from services.rerank.scorers import Scorer
from services.rerank.servicer import (
    GROUP_DOCUMENTS,
    MAX_DOCUMENTS,
    SERVICE,
    RerankServicer,
    load_scorer,
)
from services.rerank.settings import RerankSettings
from tests.conftest import health_delays
from tests.harness import InProcess

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]


class Counted:
    """The real scorer, recording the documents of each call. A call for `held_query`
    waits for `release`, so that a test can act while it is on the model thread."""

    def __init__(self, scorer: Scorer, held_query: str) -> None:
        self.scorer = scorer
        self.name = scorer.name
        self.max_tokens = scorer.max_tokens
        self.held_query = held_query
        self.calls: list[tuple[str, int]] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def token_count(self, query: str, document: str) -> int:
        return self.scorer.token_count(query, document)

    def to_unit(self, scores: list[float]) -> list[float]:
        return self.scorer.to_unit(scores)

    def score(self, query: str, documents: list[str]) -> list[float]:
        self.calls.append((query, len(documents)))
        if query == self.held_query:
            self.holding.set()
            self.release.wait(timeout=30)
        return self.scorer.score(query, documents)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servicer() -> AsyncIterator[RerankServicer]:
    model_thread = ThreadPoolExecutor(1)
    servicer = RerankServicer(model_thread)
    loop = asyncio.get_running_loop()
    servicer.scorer = await loop.run_in_executor(model_thread, load_scorer, RerankSettings())
    yield servicer
    await asyncio.to_thread(model_thread.shutdown)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(servicer: RerankServicer) -> AsyncIterator[MeshServer]:
    async def serve(server: MeshServer) -> RerankServicer:
        server.add_service(rerank_pb2_grpc.add_RerankServiceServicer_to_server, servicer, SERVICE)
        return servicer

    async with InProcess() as services:
        yield (await services.start("rerank", setup=serve)).server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(server: MeshServer) -> AsyncIterator[rerank_pb2_grpc.RerankServiceStub]:
    async with create_channel(
        f"127.0.0.1:{server.port}", MeshSettings(), services=[SERVICE]
    ) as channel:
        yield rerank_pb2_grpc.RerankServiceStub(channel)


def _documents(count: int, text: str = "passage {i} about topic {k}") -> list[rerank_pb2.Document]:
    return [rerank_pb2.Document(id=str(i), text=text.format(i=i, k=i % 7)) for i in range(count)]


async def _violations(stub, **fields) -> list[FieldViolation]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Rerank(rerank_pb2.RerankRequest(**fields), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(caught.value)


async def test_a_request_id_that_cannot_travel(stub):
    documents = _documents(2)
    assert await _violations(stub, request_id="a\tb", query="q", documents=documents) == [
        FieldViolation("request_id", request_id.RULE)
    ]
    response = await stub.Rerank(
        rerank_pb2.RerankRequest(request_id="req-1", query="topic 3", documents=documents)
    )
    assert len(response.results) == 2


async def test_too_many_documents_are_refused_without_reading_each(stub):
    assert await _violations(stub, query="q", documents=[rerank_pb2.Document()] * 10_000) == [
        FieldViolation("documents", f"must hold 1 to {MAX_DOCUMENTS} documents, got 10000")
    ]


async def test_a_cancelled_request_stops_within_a_group_and_others_go_on(
    servicer: RerankServicer,
):
    """Before, 1000 documents were one job on the model thread: the request ran to its
    end though its caller had gone, every request behind it waiting meanwhile."""
    real = servicer.scorer
    assert real is not None
    counted = Counted(real, held_query="the large one")
    servicer.scorer = counted
    try:
        large = asyncio.create_task(
            servicer.Rerank(
                rerank_pb2.RerankRequest(query="the large one", documents=_documents(1000)),
                None,
            )
        )
        assert await asyncio.to_thread(counted.holding.wait, 30)  # its first group runs
        large.cancel()
        small = asyncio.create_task(
            servicer.Rerank(
                rerank_pb2.RerankRequest(query="topic 3", documents=_documents(3)), None
            )
        )
        counted.release.set()
        response = await asyncio.wait_for(small, timeout=60)
        with pytest.raises(asyncio.CancelledError):
            await large
    finally:
        counted.release.set()
        servicer.scorer = real
    assert sorted(result.index for result in response.results) == [0, 1, 2]
    assert counted.calls == [("the large one", GROUP_DOCUMENTS), ("topic 3", 3)]


async def test_long_pairs_are_found_in_every_group(stub):
    documents = _documents(3 * GROUP_DOCUMENTS)
    long = "word " * 600
    for index in (1, 2 * GROUP_DOCUMENTS + 5):
        documents[index].text = long
    violations = await _violations(stub, query="words", documents=documents)
    assert [v.field for v in violations] == [
        "documents[1].text",
        f"documents[{2 * GROUP_DOCUMENTS + 5}].text",
    ]


async def test_groups_score_as_one_request_would(servicer: RerankServicer):
    documents = _documents(GROUP_DOCUMENTS + 5)
    request = rerank_pb2.RerankRequest(query="topic 3", documents=documents, raw_scores=True)
    response = await servicer.Rerank(request, None)
    scorer = servicer.scorer
    assert scorer is not None
    alone = await asyncio.get_running_loop().run_in_executor(
        servicer.model_thread, scorer.score, "topic 3", [d.text for d in documents]
    )
    for result in response.results:
        assert result.score == pytest.approx(alone[result.index], abs=1e-5)


@pytest.mark.system  # 5-7 s of the largest request: in the full run, not make test-fast
async def test_health_answers_while_the_largest_request_runs(stub, server):
    """1000 documents of ~16 KB (16 MB; twice that is the transport's limit) and the
    longest query: minutes of scoring, watched for a few seconds, then cancelled."""
    documents = _documents(MAX_DOCUMENTS, "passage {i} " + "é word 🙂 " * 1200)
    request = rerank_pb2.RerankRequest(query="q " * 4096, documents=documents, truncate=True)
    call = stub.Rerank(request, timeout=300)
    done = threading.Event()
    watching = asyncio.get_running_loop().call_later(4, done.set)
    try:
        delays = await asyncio.to_thread(health_delays, server.port, done, "")
    finally:
        watching.cancel()
        call.cancel()
    assert len(delays) >= 5
    assert max(delays) < 1.0
    response = await stub.Rerank(
        rerank_pb2.RerankRequest(query="topic 3", documents=_documents(3)), timeout=60
    )
    assert len(response.results) == 3
