"""Rerank over real gRPC with the embedded late-interaction scorer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from mesh.errors import field_violations
from services.rerank.servicer import SERVICE
from tests.harness import InProcess

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

DOCUMENTS = [
    ("heapq.heappush", "heapq.heappush(heap, item): push item onto the heap."),
    ("shutil.rmtree", "shutil.rmtree(path): recursively delete a directory tree."),
    ("json.loads", "json.loads(s): deserialize a str containing a JSON document."),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub() -> AsyncIterator[rerank_pb2_grpc.RerankServiceStub]:
    async with InProcess() as services:
        served = await services.start("rerank")
        yield rerank_pb2_grpc.RerankServiceStub(services.channel(served.target, SERVICE))


def request(query: str, **fields) -> rerank_pb2.RerankRequest:
    documents = fields.pop("documents", [rerank_pb2.Document(id=i, text=t) for i, t in DOCUMENTS])
    return rerank_pb2.RerankRequest(query=query, documents=documents, **fields)


async def test_the_relevant_document_comes_first_with_unit_scores(stub):
    response = await stub.Rerank(request("how do I remove a folder and its contents?"))
    assert response.results[0].id == "shutil.rmtree"
    assert response.results[0].index == 1
    assert response.model == "minilm-late-interaction"
    scores = [r.score for r in response.results]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert {s.name for s in response.timing.stages} == {"queue", "inference"}


async def test_top_n_text_and_raw_scores(stub):
    response = await stub.Rerank(
        request("parse a JSON string", top_n=1, return_documents=True, raw_scores=True)
    )
    (best,) = response.results
    assert best.id == "json.loads" and best.text == DOCUMENTS[2][1]
    assert -1 <= best.score <= 1
    plain = await stub.Rerank(request("parse a JSON string"))
    assert all(r.text == "" for r in plain.results)


async def test_many_documents_are_split_into_passes_and_all_scored(stub):
    documents = [
        rerank_pb2.Document(id=str(i), text=f"passage {i} about topic number {i % 7}")
        for i in range(300)
    ]
    response = await stub.Rerank(request("topic number 3", documents=documents))
    assert sorted(r.index for r in response.results) == list(range(300))


async def test_long_documents_need_truncate(stub):
    long = rerank_pb2.Document(id="long", text="word " * 2000)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Rerank(request("words", documents=[long]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(caught.value)] == ["documents[0].text"]
    cut = await stub.Rerank(request("words", documents=[long], truncate=True))
    assert len(cut.results) == 1


BAD = [
    ({"query": ""}, "query"),
    ({"query": "x", "documents": []}, "documents"),
    ({"query": "x", "documents": [rerank_pb2.Document(text="a")] * 1001}, "documents"),
    ({"query": "x", "documents": [rerank_pb2.Document(id="e", text="")]}, "documents[0].text"),
    (
        {"query": "x", "documents": [rerank_pb2.Document(text="y" * (64 * 1024 + 1))]},
        "documents[0].text",
    ),
    ({"query": "x", "top_n": -1}, "top_n"),
]


@pytest.mark.parametrize(("fields", "field"), BAD)
async def test_bad_input_names_the_field(stub, fields, field):
    query = fields.pop("query")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Rerank(request(query, **fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in {v.field for v in field_violations(caught.value)}


async def test_usage_counts_every_pairs_tokens_cut_at_the_models_length(stub):
    short = await stub.Rerank(request("parse a JSON string"))
    long_text = "a very long document " * 300
    cut = await stub.Rerank(
        request("q", documents=[rerank_pb2.Document(text=long_text)], truncate=True)
    )
    assert short.usage.prompt_tokens == short.usage.total_tokens > 3 * 5
    assert cut.usage.prompt_tokens == 512  # MiniLM's length: the pair was cut there
