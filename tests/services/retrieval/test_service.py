"""Retrieval over real gRPC: an embedder and a retrieval server on 127.0.0.1, embedded
Qdrant in a temporary folder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.protobuf import struct_pb2

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.errors import field_violations
from services.retrieval.servicer import SERVICE
from services.retrieval.store import derived_id
from tests.harness import InProcess
from tests.services.retrieval.conftest import start_retrieval

DOCS = {
    "json.load": "json.load(fp): deserialize a JSON document read from a file object to a "
    "Python object.",
    "shutil.rmtree": "shutil.rmtree(path): recursively delete a directory tree.",
    "subprocess.run": "subprocess.run(args, capture_output=False): run a command, wait for it "
    "to complete, then return a CompletedProcess with its output.",
    "copy.deepcopy": "copy.deepcopy(x): return a deep copy of x, copying nested containers.",
    "heapq.heappush": "heapq.heappush(heap, item): push item onto the heap, keeping the heap "
    "invariant.",
}


pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(tmp_path_factory) -> AsyncIterator[retrieval_pb2_grpc.RetrievalServiceStub]:
    async with InProcess() as services:
        _, retrieval = await start_retrieval(tmp_path_factory.mktemp("qdrant"), services=services)
        channel = services.channel(f"127.0.0.1:{retrieval.port}", SERVICE)
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        await stub.CreateCollection(
            retrieval_pb2.CreateCollectionRequest(collection="docs", sparse_enabled=True)
        )
        await stub.Upsert(_messages(DOCS, module_payload=True))
        yield stub


def _payload(values: dict) -> struct_pb2.Struct:
    payload = struct_pb2.Struct()
    payload.update(values)
    return payload


async def _messages(
    docs: dict[str, str], collection: str = "docs", module_payload: bool = False, per: int = 2
) -> AsyncIterator[retrieval_pb2.UpsertRequest]:
    items = list(docs.items())
    for start in range(0, len(items), per):
        yield retrieval_pb2.UpsertRequest(
            collection=collection,
            documents=[
                retrieval_pb2.Document(
                    id=doc_id,
                    text=text,
                    payload=_payload(
                        {"module": doc_id.split(".")[0], "length": len(text)}
                        if module_payload
                        else {}
                    ),
                )
                for doc_id, text in items[start : start + per]
            ],
        )


def search(**fields) -> retrieval_pb2.SearchRequest:
    return retrieval_pb2.SearchRequest(collection="docs", **fields)


async def test_collections_are_idempotent_and_refuse_different_settings(stub):
    again = await stub.CreateCollection(
        retrieval_pb2.CreateCollectionRequest(collection="docs", sparse_enabled=True)
    )
    assert not again.created and again.vector_size == 384
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateCollection(
            retrieval_pb2.CreateCollectionRequest(collection="docs", sparse_enabled=False)
        )
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateCollection(
            retrieval_pb2.CreateCollectionRequest(collection="other", vector_size=768)
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(caught.value)] == ["vector_size"]


async def test_search_modes_find_the_answer_and_explain_their_sources(stub):
    for mode in (
        retrieval_pb2.SEARCH_MODE_DENSE,
        retrieval_pb2.SEARCH_MODE_SPARSE,
        retrieval_pb2.SEARCH_MODE_HYBRID,
    ):
        found = await stub.Search(
            search(query="delete a folder and everything in it", mode=mode, top_k=3)
        )
        if mode != retrieval_pb2.SEARCH_MODE_SPARSE:  # BM25 shares no word with the query
            assert found.hits[0].id == "shutil.rmtree"
        assert {s.name for s in found.timing.stages} == {"embed", "search"}
    hybrid = await stub.Search(search(query="run a command and capture its output", top_k=5))
    top = hybrid.hits[0]
    assert top.id == "subprocess.run"
    assert {s.retriever for s in top.sources} == {
        retrieval_pb2.RETRIEVER_DENSE,
        retrieval_pb2.RETRIEVER_SPARSE,
    }
    assert all(s.rank >= 1 for s in top.sources)
    assert [h.score for h in hybrid.hits] == sorted((h.score for h in hybrid.hits), reverse=True)


async def test_filters_thresholds_and_payloads(stub):
    only_json = await stub.Search(
        search(
            query="read data from a file",
            with_payload=True,
            filter=retrieval_pb2.Filter(
                must=[retrieval_pb2.Condition(key="module", keyword="json")]
            ),
        )
    )
    assert [h.id for h in only_json.hits] == ["json.load"]
    assert only_json.hits[0].payload["module"] == "json"
    not_json = await stub.Search(
        search(
            query="read data from a file",
            filter=retrieval_pb2.Filter(
                must_not=[retrieval_pb2.Condition(key="module", keyword="json")]
            ),
        )
    )
    assert "json.load" not in {h.id for h in not_json.hits}
    short = await stub.Search(
        search(
            query="copy",
            filter=retrieval_pb2.Filter(
                must=[retrieval_pb2.Condition(key="length", range=retrieval_pb2.Range(lt=80))]
            ),
        )
    )
    assert {h.id for h in short.hits} <= {"shutil.rmtree", "copy.deepcopy"}
    strict = await stub.Search(
        search(
            query="deep copy of nested lists",
            mode=retrieval_pb2.SEARCH_MODE_DENSE,
            score_threshold=0.5,
        )
    )
    assert strict.hits and all(h.score >= 0.5 for h in strict.hits)


async def test_reupserting_the_same_content_writes_nothing_and_ids_derive_from_text(stub):
    again = await stub.Upsert(_messages(DOCS, module_payload=True))
    assert (again.received, again.upserted, again.unchanged) == (5, 0, 5)

    async def anonymous() -> AsyncIterator[retrieval_pb2.UpsertRequest]:
        yield retrieval_pb2.UpsertRequest(
            collection="docs",
            documents=[retrieval_pb2.Document(text="bisect.insort: insert keeping order.")],
        )

    first = await stub.Upsert(anonymous())
    second = await stub.Upsert(anonymous())
    assert first.ids == second.ids == [derived_id("bisect.insort: insert keeping order.")]
    assert (first.upserted, second.unchanged) == (1, 1)
    deleted = await stub.Delete(retrieval_pb2.DeleteRequest(collection="docs", ids=first.ids))
    assert deleted.deleted == 1


async def test_an_upload_failing_half_way_keeps_what_came_before_and_nothing_of_the_rest(stub):
    await stub.CreateCollection(retrieval_pb2.CreateCollectionRequest(collection="partial"))
    good = {f"doc.{i}": f"document number {i} about topic {i}" for i in range(4)}

    async def stream() -> AsyncIterator[retrieval_pb2.UpsertRequest]:
        async for message in _messages(good, collection="partial"):
            yield message
        yield retrieval_pb2.UpsertRequest(
            documents=[
                retrieval_pb2.Document(id="late.ok", text="fine on its own"),
                retrieval_pb2.Document(id="late.bad", text="x" * (64 * 1024 + 1)),
            ]
        )

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Upsert(stream())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(caught.value)] == ["upsert[2].documents[1].text"]
    found = await stub.Search(
        retrieval_pb2.SearchRequest(collection="partial", query="document", top_k=10)
    )
    assert {h.id for h in found.hits} == set(good)  # both earlier batches, nothing of the third


async def test_delete_by_filter_counts_what_it_removed(stub):
    await stub.CreateCollection(retrieval_pb2.CreateCollectionRequest(collection="scratch"))
    docs = {"a.one": "alpha one", "a.two": "alpha two", "b.one": "beta one"}
    await stub.Upsert(_messages(docs, collection="scratch", module_payload=True))
    removed = await stub.Delete(
        retrieval_pb2.DeleteRequest(
            collection="scratch",
            filter=retrieval_pb2.Filter(must=[retrieval_pb2.Condition(key="module", keyword="a")]),
        )
    )
    assert removed.deleted == 2
    gone = await stub.Delete(retrieval_pb2.DeleteRequest(collection="scratch", ids=["a.one"]))
    assert gone.deleted == 0


BAD_SEARCHES = [
    ({"query": ""}, "query"),
    ({"query": "x", "top_k": 0}, "top_k"),
    ({"query": "x", "top_k": 10**6}, "top_k"),
    (
        {"query": "x", "filter": retrieval_pb2.Filter(must=[retrieval_pb2.Condition(key="m")])},
        "filter.must[0]",
    ),
    (
        {
            "query": "x",
            "filter": retrieval_pb2.Filter(
                must=[retrieval_pb2.Condition(key="n", range=retrieval_pb2.Range())]
            ),
        },
        "filter.must[0].range",
    ),
    (
        {
            "query": "x",
            "filter": retrieval_pb2.Filter(
                must=[retrieval_pb2.Condition(key="_aimesh_text", keyword="y")]
            ),
        },
        "filter.must[0].key",
    ),
    ({"query": "x" * 9000}, "query"),
]


@pytest.mark.parametrize(("fields", "field"), BAD_SEARCHES)
async def test_bad_searches_name_the_field(stub, fields, field):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Search(search(**fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in {v.field for v in field_violations(caught.value)}


async def test_unknown_collection_is_not_found(stub):
    for call in (
        stub.Search(retrieval_pb2.SearchRequest(collection="nope", query="x")),
        stub.Delete(retrieval_pb2.DeleteRequest(collection="nope", ids=["a"])),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_delete_needs_exactly_one_selector(stub):
    for request in (
        retrieval_pb2.DeleteRequest(collection="docs"),
        retrieval_pb2.DeleteRequest(
            collection="docs",
            ids=["a"],
            filter=retrieval_pb2.Filter(must=[retrieval_pb2.Condition(key="m", keyword="x")]),
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Delete(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_concurrent_searches_all_answer(stub):
    results = await asyncio.gather(
        *(stub.Search(search(query=f"heap push {i}")) for i in range(12))
    )
    assert all(r.hits[0].id == "heapq.heappush" for r in results)
