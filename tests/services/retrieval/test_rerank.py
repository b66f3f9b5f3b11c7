"""Search with rerank: retrieval calls the rerank service itself, looks
max(4 * top_k, 20) deep once, orders by the reranker's scores, and answers in retrieval
order with a note when the reranker is unavailable.

The engine is driven directly (no grpc: plain callables stand in for the embedder and the
reranker), then the servicer over real gRPC with a fake rerank server at its boundary.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.config import BreakerSettings
from mesh.server import MeshServer
from services.retrieval import engine as engine_module
from services.retrieval.calls import StoreCalls
from services.retrieval.engine import (
    Incoming,
    KnowledgeBase,
    Query,
    RerankUnavailable,
    rerank_candidates,
)
from services.retrieval.servicer import SERVICE
from services.retrieval.settings import RetrievalSettings
from services.retrieval.store import open_store
from tests.conftest import free_port
from tests.harness import InProcess
from tests.services.retrieval.conftest import retrieval_settings

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

# 30 passages: "topic 0" ... "topic 29"; the fake reranker prefers the highest number.
PASSAGES = {f"p{n:02d}": f"topic {n}: notes about topic number {n}" for n in range(30)}


def _number(text: str) -> int:
    return int(text.split(":")[0].removeprefix("topic "))


async def fake_embed(texts: list[str]) -> list[list[float]]:
    return [[1 + b / 255 for b in hashlib.sha256(t.encode()).digest()[:8]] for t in texts]


class FakeReranker:
    """Scores a passage by its topic number; records every call. `down` makes it answer
    as a reranker that is unavailable does."""

    def __init__(self, down: str | None = None) -> None:
        self.down = down
        self.calls: list[tuple[str, list[str], int]] = []

    async def __call__(
        self, query: str, documents: list[tuple[str, str]], top_n: int
    ) -> list[tuple[int, float]]:
        self.calls.append((query, [doc_id for doc_id, _ in documents], top_n))
        if self.down is not None:
            raise RerankUnavailable(self.down)
        scores = [float(_number(text)) for _, text in documents]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return [(i, scores[i]) for i in order]


# ---- the engine alone: no grpc anywhere in the calls ----


async def test_the_engine_module_imports_no_grpc():
    tree = ast.parse(inspect.getsource(engine_module))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {"grpc", "aimesh", "google"} & imported


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def knowledge(tmp_path_factory) -> AsyncIterator[tuple[KnowledgeBase, list[FakeReranker]]]:
    """A knowledge base on embedded Qdrant whose reranker is whichever FakeReranker the
    test puts first in the list."""
    settings = RetrievalSettings(path=Path(tmp_path_factory.mktemp("engine")))
    rerankers = [FakeReranker()]

    async def rerank(query: str, documents: list[tuple[str, str]], top_n: int):
        return await rerankers[0](query, documents, top_n)

    thread = ThreadPoolExecutor(1)
    engine = KnowledgeBase(
        settings, StoreCalls("test", 10, BreakerSettings(), thread), fake_embed, rerank
    )
    await engine.open(lambda: open_store(settings, settings.path))
    assert engine.dimensions == 8
    assert await engine.create("docs", "cosine", sparse=True, on_disk=False)

    async def batches() -> AsyncIterator[list[Incoming]]:
        yield [
            Incoming.of(doc_id, text, {"n": n}) for n, (doc_id, text) in enumerate(PASSAGES.items())
        ]

    done = await engine.upsert("docs", batches())
    assert (done.received, done.upserted, done.unchanged) == (30, 30, 0)
    yield engine, rerankers
    await engine.close()
    thread.shutdown()


async def test_the_engine_orders_a_reranked_search_by_the_reranker(knowledge):
    engine, rerankers = knowledge
    reranker = rerankers[0] = FakeReranker()
    plain = await engine.search(Query("docs", "notes about topic number", top_k=3))
    found = await engine.search(Query("docs", "notes about topic number", top_k=3, rerank=True))
    assert plain.rerank_s is None and found.rerank_s is not None and not found.note
    (call,) = reranker.calls  # the candidate rule applied once, in the engine
    assert call[2] == 3 and len(call[1]) == rerank_candidates(3) == 20
    # The reranker's best three of its 20 candidates, with its scores.
    numbers = sorted((_number(PASSAGES[doc_id]) for doc_id in call[1]), reverse=True)[:3]
    assert [_number(h.text) for h in found.hits] == numbers
    assert [h.score for h in found.hits] == [float(n) for n in numbers]
    assert [h.doc_id for h in plain.hits] != [h.doc_id for h in found.hits]
    assert all(h.sources for h in found.hits)  # where each retriever ranked it stays


@pytest.mark.parametrize(("top_k", "depth"), [(1, 20), (5, 20), (6, 24), (25, 100)])
async def test_a_reranked_search_looks_four_times_deeper_and_at_least_20(knowledge, top_k, depth):
    engine, rerankers = knowledge
    reranker = rerankers[0] = FakeReranker()
    found = await engine.search(Query("docs", "topic", top_k=top_k, rerank=True, mode="dense"))
    (call,) = reranker.calls
    assert len(call[1]) == min(depth, len(PASSAGES)) and call[2] == top_k
    assert len(found.hits) == min(top_k, len(PASSAGES))


async def test_the_engine_answers_in_retrieval_order_when_the_reranker_is_down(knowledge):
    engine, rerankers = knowledge
    rerankers[0] = FakeReranker(down="UNAVAILABLE")
    plain = await engine.search(Query("docs", "notes about topic number", top_k=4))
    found = await engine.search(Query("docs", "notes about topic number", top_k=4, rerank=True))
    assert [(h.doc_id, h.score) for h in found.hits] == [(h.doc_id, h.score) for h in plain.hits]
    assert found.note.startswith("reranking unavailable (UNAVAILABLE)")
    assert "retrieval order" in found.note and "hybrid" in found.note


async def test_nothing_found_is_not_sent_to_the_reranker(knowledge):
    engine, rerankers = knowledge
    reranker = rerankers[0] = FakeReranker()
    found = await engine.search(
        Query("docs", "topic", top_k=3, rerank=True, threshold=1e6, mode="dense")
    )
    assert found.hits == [] and reranker.calls == [] and not found.note


# ---- over the wire: retrieval dials a rerank server ----


class FakeRerankService(rerank_pb2_grpc.RerankServiceServicer):
    """A cross-encoder at the gRPC boundary: prefers higher topic numbers, or refuses."""

    def __init__(self, code: grpc.StatusCode | None = None) -> None:
        self.code = code
        self.requests: list[rerank_pb2.RerankRequest] = []

    async def Rerank(self, request, context):
        self.requests.append(request)
        if self.code is not None:
            await context.abort(self.code, "fake rerank refuses")
        scores = [float(_number(d.text)) for d in request.documents]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n or None]
        return rerank_pb2.RerankResponse(
            results=[
                rerank_pb2.RerankResult(index=i, id=request.documents[i].id, score=scores[i])
                for i in order
            ]
        )


async def _rerank_server(services: InProcess, servicer: FakeRerankService) -> str:
    async def register(server: MeshServer) -> None:
        server.add_service(
            rerank_pb2_grpc.add_RerankServiceServicer_to_server,
            servicer,
            rerank_pb2.DESCRIPTOR.services_by_name["RerankService"],
        )

    return (await services.start("rerank", setup=register)).target


async def _searching(
    services: InProcess, fake_embedder: MeshServer, rerank: str, tmp_path: Path
) -> retrieval_pb2_grpc.RetrievalServiceStub:
    settings = retrieval_settings(fake_embedder, rerank=rerank, path=str(tmp_path))
    retrieval = await services.start("retrieval", settings)
    stub = retrieval_pb2_grpc.RetrievalServiceStub(services.channel(retrieval.target, SERVICE))
    await stub.CreateCollection(
        retrieval_pb2.CreateCollectionRequest(collection="docs", sparse_enabled=True)
    )

    async def messages():
        yield retrieval_pb2.UpsertRequest(
            collection="docs",
            documents=[retrieval_pb2.Document(id=i, text=t) for i, t in PASSAGES.items()],
        )

    await stub.Upsert(messages())
    return stub


def _search(top_k: int = 3, rerank: bool = True) -> retrieval_pb2.SearchRequest:
    return retrieval_pb2.SearchRequest(
        collection="docs", query="notes about topic number", top_k=top_k, rerank=rerank
    )


async def test_search_with_rerank_orders_by_the_rerank_service(fake_embedder, tmp_path):
    fake = FakeRerankService()
    async with InProcess() as services:
        stub = await _searching(
            services, fake_embedder, await _rerank_server(services, fake), tmp_path
        )
        found = await stub.Search(_search(top_k=3))
        (request,) = fake.requests
        assert len(request.documents) == 20 and request.top_n == 3 and request.truncate
        best = sorted((_number(d.text) for d in request.documents), reverse=True)[:3]
        assert [_number(h.text) for h in found.hits] == best
        assert [h.score for h in found.hits] == [float(n) for n in best]
        assert not found.note
        assert {s.name for s in found.timing.stages} == {"embed", "search", "rerank"}

        plain = await stub.Search(_search(top_k=3, rerank=False))
        assert len(fake.requests) == 1  # no rerank asked, none called
        assert "rerank" not in {s.name for s in plain.timing.stages}


async def test_search_with_rerank_down_answers_in_retrieval_order_with_a_note(
    fake_embedder, tmp_path
):
    async with InProcess() as services:
        stub = await _searching(services, fake_embedder, f"127.0.0.1:{free_port()}", tmp_path)
        plain = await stub.Search(_search(top_k=4, rerank=False))
        found = await stub.Search(_search(top_k=4))
        assert [h.id for h in found.hits] == [h.id for h in plain.hits]
        assert [h.score for h in found.hits] == [h.score for h in plain.hits]
        assert found.note.startswith("reranking unavailable (UNAVAILABLE)")
        assert not plain.note


@pytest.mark.parametrize(
    ("code", "degrades"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, True),
        (grpc.StatusCode.INVALID_ARGUMENT, False),
    ],
)
async def test_only_a_rerank_outage_degrades_a_search(fake_embedder, tmp_path, code, degrades):
    async with InProcess() as services:
        target = await _rerank_server(services, FakeRerankService(code))
        stub = await _searching(services, fake_embedder, target, tmp_path)
        if degrades:
            found = await stub.Search(_search())
            assert found.note.startswith(f"reranking unavailable ({code.name})")
            assert len(found.hits) == 3
        else:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Search(_search())
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert code.name in caught.value.details()
