"""Retrieval under bad input, heavy input and a missing Qdrant: each caller gets its own
answer (INVALID_ARGUMENT naming the field, UNAVAILABLE) and the service stays responsive.

The embedder is a fake at its gRPC boundary (conftest.FakeEmbedder): these tests are about
retrieval's own handling, and need no model.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh import caller, deadline
from mesh.breaker import State
from mesh.client import create_channel
from mesh.config import BreakerSettings, MeshSettings, TransportSettings
from mesh.errors import error_info, field_violations
from mesh.failures import NotFound, NotReady
from mesh.server import MeshServer
from services.retrieval.calls import StoreCalls
from services.retrieval.engine import KnowledgeBase
from services.retrieval.servicer import SERVICE, RetrievalServicer
from services.retrieval.servicer import setup as retrieval_setup
from services.retrieval.settings import RetrievalSettings
from tests.conftest import health_delays
from tests.harness import InProcess
from tests.services.retrieval.conftest import retrieval_settings

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

UPSERT = "/aimesh.retrieval.v1.RetrievalService/Upsert"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(fake_retrieval) -> AsyncIterator[retrieval_pb2_grpc.RetrievalServiceStub]:
    async with create_channel(
        f"127.0.0.1:{fake_retrieval.port}", MeshSettings(), services=[SERVICE]
    ) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        await stub.CreateCollection(
            retrieval_pb2.CreateCollectionRequest(collection="docs", sparse_enabled=True)
        )
        await stub.Upsert(
            _stream(
                [
                    retrieval_pb2.Document(
                        id="json.load", text="json.load: read JSON", payload=_struct(m="json")
                    ),
                    retrieval_pb2.Document(id="os.rmdir", text="os.rmdir: remove a directory"),
                ]
            )
        )
        yield stub


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def raw(fake_retrieval) -> AsyncIterator[grpc.aio.Channel]:
    """A channel that sends bytes as they are, for messages protobuf refuses to build."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fake_retrieval.port}") as channel:
        yield channel


def _struct(**values: object) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


async def _stream(
    documents: list[retrieval_pb2.Document], collection: str = "docs", per: int = 256
) -> AsyncIterator[retrieval_pb2.UpsertRequest]:
    for start in range(0, len(documents), per):
        yield retrieval_pb2.UpsertRequest(
            collection=collection, documents=documents[start : start + per]
        )


async def _refusal(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, data: bytes) -> bytes:
    """One length-delimited field, encoded by hand."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _nested(depth: int) -> struct_pb2.Struct:
    """{"k": {"k": ... {"x": 1}}}, `depth` objects deep, built in place: protobuf refuses to
    copy one deeper than its recursion limit."""
    struct = struct_pb2.Struct()
    inner = struct
    for _ in range(depth - 1):
        inner = inner.get_or_create_struct("k")
    inner["x"] = 1
    return struct


# ---- CPU work stays off the event loop ----


@pytest.mark.system  # 5-7 s of the largest request: in the full run, not make test-fast
async def test_health_answers_while_a_large_upsert_is_processed(stub, fake_retrieval):
    await stub.CreateCollection(
        retrieval_pb2.CreateCollectionRequest(collection="big", sparse_enabled=True)
    )
    # 256 documents of ~58 KB, 15,000 terms each: ~4 s of BM25, which stalled the event
    # loop throughout.
    documents = [
        retrieval_pb2.Document(
            id=f"big.{i}", text=" ".join(f"{chr(97 + j % 26)}{(i + j) % 97}" for j in range(15_000))
        )
        for i in range(256)
    ]
    done = threading.Event()
    upsert = asyncio.ensure_future(stub.Upsert(_stream(documents, "big"), timeout=300))
    upsert.add_done_callback(lambda _: done.set())
    delays = await asyncio.to_thread(health_delays, fake_retrieval.port, done, "retrieval")
    assert (await upsert).upserted == 256
    assert len(delays) >= 5  # the checks overlapped the upsert's work
    assert max(delays) < 1.0


# ---- Qdrant is a dependency: deadline, breaker, UNAVAILABLE, readiness ----


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _fake_qdrant(port: int) -> asyncio.Server:
    """Answers any request as Qdrant's root does: enough for a probe that asks its version."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"title": "qdrant - vector search engine", "version": "1.12.0"}'
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", port)


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return response.status


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 20) -> None:
    give_up = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < give_up, "the condition never held"
        await asyncio.sleep(0.1)


def _reason(error: grpc.aio.AioRpcError) -> str:
    info = error_info(error)
    return info.reason if info is not None else ""


# qdrant-client's own version check, made once at startup, finds no server to ask.
@pytest.mark.filterwarnings("ignore:Failed to obtain server version")
async def test_a_qdrant_server_that_is_down_is_unavailable_and_readiness_follows_it(fake_embedder):
    port = _free_port()
    settings = retrieval_settings(fake_embedder, url=f"http://127.0.0.1:{port}", timeout_s=5)
    set_up: list[MeshServer] = []

    async def recorded(server: MeshServer) -> None:
        set_up.append(server)
        await retrieval_setup(server)

    services = InProcess()
    starting = asyncio.ensure_future(services.start("retrieval", settings, setup=recorded))
    fake: asyncio.Server | None = None
    try:

        async def listening() -> bool:
            return bool(set_up) and set_up[0].port != 0

        await _until(listening)
        (server,) = set_up
        await asyncio.sleep(1)
        # Warm-up opened the store and waits for Qdrant: not ready, though alive.
        assert await _health(server.port, "") == health_pb2.HealthCheckResponse.SERVING
        assert await _health(server.port, "retrieval") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not starting.done()

        fake = await _fake_qdrant(port)
        await asyncio.wait_for(starting, 30)  # Qdrant came: the warm-up finished
        assert await _health(server.port, "retrieval") == health_pb2.HealthCheckResponse.SERVING

        fake.close()
        await fake.wait_closed()
        fake = None

        async def not_ready() -> bool:
            return await _health(server.port, "retrieval") == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )

        await _until(not_ready)
        assert await _health(server.port, "") == health_pb2.HealthCheckResponse.SERVING
        async with create_channel(
            f"127.0.0.1:{server.port}", MeshSettings(), services=[SERVICE]
        ) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            search = retrieval_pb2.SearchRequest(collection="docs", query="x")
            started = time.monotonic()
            calls = [
                lambda: stub.Upsert(_stream([retrieval_pb2.Document(text="t")]), timeout=30),
                lambda: stub.CreateCollection(
                    retrieval_pb2.CreateCollectionRequest(collection="docs"), timeout=30
                ),
                lambda: stub.Delete(
                    retrieval_pb2.DeleteRequest(collection="docs", ids=["a"]), timeout=30
                ),
                *[lambda: stub.Search(search, timeout=30)] * 12,
            ]
            errors = [await _refusal(call()) for call in calls]  # one after another
            assert time.monotonic() - started < 10  # refused, not hung to the deadline
            assert {e.code() for e in errors} == {grpc.StatusCode.UNAVAILABLE}
            assert {_reason(e) for e in errors} == {"VECTOR_STORE_UNAVAILABLE", "CIRCUIT_OPEN"}
            assert _reason(errors[-1]) == "CIRCUIT_OPEN"  # the breaker spares Qdrant

        fake = await _fake_qdrant(port)

        async def ready() -> bool:
            return await _health(server.port, "retrieval") == (
                health_pb2.HealthCheckResponse.SERVING
            )

        await _until(ready)
    finally:
        if fake is not None:
            fake.close()
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await services.close()


def _missing() -> None:
    raise NotFound("no such collection", resource_type="collection", resource_name="x")


def _refused() -> None:
    raise UnexpectedResponse(400, "Bad Request", b"{}", httpx.Headers())


def _down() -> None:
    raise ResponseHandlingException(ConnectionRefusedError("connection refused"))


async def test_only_the_stores_own_failures_open_its_breaker():
    thread = ThreadPoolExecutor(1)
    calls = StoreCalls("test", 5, BreakerSettings(window_size=4, minimum_calls=4), thread)
    try:
        for work, raised in [(_missing, NotFound), (_refused, UnexpectedResponse)] * 4:
            with pytest.raises(raised):
                await calls.run(work)
        assert calls.breaker.state is State.CLOSED
        # The window holds the 4 answered calls (the 400s count for nothing): 2 failures
        # out of 4 reach the 50% failure rate.
        for _ in range(2):
            with pytest.raises(NotReady) as caught:
                await calls.run(_down)
            assert caught.value.reason == "VECTOR_STORE_UNAVAILABLE"
        error = await _refusal(calls.run(_missing))
        assert (error.code(), _reason(error)) == (grpc.StatusCode.UNAVAILABLE, "CIRCUIT_OPEN")
    finally:
        thread.shutdown()


async def test_a_store_call_that_hangs_ends_at_its_timeout_or_the_callers_deadline():
    thread = ThreadPoolExecutor(1)
    calls = StoreCalls("test", 0.5, BreakerSettings(), thread)
    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(NotReady) as caught:
            await calls.run(release.wait, 60)
        assert caught.value.reason == "VECTOR_STORE_UNAVAILABLE"
        with deadline.budget(0.2):  # queued behind the hung call: dropped at the deadline
            error = await _refusal(calls.run(release.wait, 60))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 10
    finally:
        release.set()
        thread.shutdown()


async def test_calls_before_the_store_opens_are_unavailable_not_internal(tmp_path):
    async def never(*args: Any) -> Any:
        raise AssertionError("no call reaches a dependency before the store opens")

    with ThreadPoolExecutor(1) as thread:
        calls = StoreCalls("test", 5, BreakerSettings(), thread)
        engine = KnowledgeBase(RetrievalSettings(path=tmp_path), calls, never, never)
        servicer = RetrievalServicer(engine, max_message_bytes=4 * 1024 * 1024)
        with pytest.raises(NotReady):
            await servicer.Search(retrieval_pb2.SearchRequest(collection="docs", query="x"), None)
        with pytest.raises(NotReady):
            await servicer.Delete(retrieval_pb2.DeleteRequest(collection="docs", ids=["a"]), None)


# ---- malformed input is the caller's, and named ----

LONG = "x" * 300_000

BAD_SEARCHES = [
    ({"collection": LONG}, "collection"),
    ({"collection": "dócs"}, "collection"),
    ({"query": LONG}, "query"),
    ({"query": " \t\n"}, "query"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2**31 - 1}, "top_k"),
    ({"score_threshold": math.nan}, "score_threshold"),
    ({"score_threshold": math.inf}, "score_threshold"),
    ({"mode": 99}, "mode"),
    *(
        (
            {"filter": retrieval_pb2.Filter(must=[retrieval_pb2.Condition(key=key, keyword="x")])},
            "filter.must[0].key",
        )
        for key in ("a b", "a..b", "a[", "$", "a[-1]", '"_aimesh_text"', "k" * 300, LONG)
    ),
    (
        {"filter": retrieval_pb2.Filter(must=[retrieval_pb2.Condition(key="m", keyword=LONG)])},
        "filter.must[0].keyword",
    ),
    (
        {
            "filter": retrieval_pb2.Filter(
                should=[retrieval_pb2.Condition(key="m", boolean=True)] * 100_000
            )
        },
        "filter",
    ),
]


@pytest.mark.parametrize(("fields", "field"), BAD_SEARCHES)
async def test_bad_searches_name_the_field(stub, fields, field):
    request = retrieval_pb2.SearchRequest(**{"collection": "docs", "query": "x", **fields})
    error = await _refusal(stub.Search(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in {v.field for v in field_violations(error)}


async def test_searches_that_are_odd_but_valid_answer(stub):
    unknown_key = retrieval_pb2.Filter(
        must=[retrieval_pb2.Condition(key='meta."odd key"[0].é', keyword="x")]
    )
    for request in (
        retrieval_pb2.SearchRequest(collection="docs", query="x", filter=unknown_key),
        retrieval_pb2.SearchRequest(collection="docs", query="x", score_threshold=-5),
        retrieval_pb2.SearchRequest(collection="docs", query="the of and", mode=2),
        retrieval_pb2.SearchRequest(collection="docs", query="Ünïcødé ✓ 検索"),
    ):
        await stub.Search(request)
    found = await stub.Search(
        retrieval_pb2.SearchRequest(collection="docs", query="x", filter=unknown_key)
    )
    assert not found.hits


def _doc(**fields: object) -> retrieval_pb2.Document:
    return retrieval_pb2.Document(**{"text": "some text", **fields})


BAD_UPSERTS = [
    (_doc(payload=_struct(n=math.nan)), "upsert[0].documents[0].payload.n"),
    (_doc(payload=_struct(a={"b": [1, math.inf]})), "upsert[0].documents[0].payload.a.b[1]"),
    (_doc(payload=_struct(n=-math.inf)), "upsert[0].documents[0].payload.n"),
    (_doc(payload=_nested(20)), "upsert[0].documents[0].payload" + ".k" * 16),
    (_doc(payload=_struct(big=LONG)), "upsert[0].documents[0].payload"),
    (_doc(payload=_struct(_aimesh_text="x")), "upsert[0].documents[0].payload"),
    (_doc(id=LONG), "upsert[0].documents[0].id"),
    (_doc(text=LONG), "upsert[0].documents[0].text"),
    (_doc(text=""), "upsert[0].documents[0].text"),
]


@pytest.mark.parametrize(("document", "field"), BAD_UPSERTS)
async def test_bad_upserts_name_the_field(stub, document, field):
    error = await _refusal(stub.Upsert(_stream([document])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in {v.field for v in field_violations(error)}


@pytest.mark.parametrize("collection", [LONG, "dócs", ""])
async def test_upserts_to_a_bad_collection_name_the_field(stub, collection):
    error = await _refusal(stub.Upsert(_stream([_doc()], collection)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(error)] == ["upsert[0].collection"]


async def test_a_payload_nested_60_deep_is_refused_naming_it(raw):
    upsert = raw.stream_unary(UPSERT, response_deserializer=retrieval_pb2.UpsertResponse.FromString)
    document = _doc().SerializeToString() + _field(3, _nested(60).SerializeToString())
    message = retrieval_pb2.UpsertRequest(collection="docs").SerializeToString()

    async def stream() -> AsyncIterator[bytes]:
        yield message + _field(3, _doc().SerializeToString()) + _field(3, document)

    error = await _refusal(upsert(stream()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(error)] == ["documents"]  # the mesh's parser


async def test_a_message_of_many_bad_documents_still_names_them(stub):
    error = await _refusal(stub.Upsert(_stream([_doc(text="", payload=_struct(n=math.nan))] * 256)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED
    fields = [v.field for v in field_violations(error)]
    assert fields[:2] == ["upsert[0].documents[0].text", "upsert[0].documents[0].payload.n"]


async def test_a_refused_message_keeps_the_batches_before_it_and_nothing_of_itself(stub):
    await stub.CreateCollection(retrieval_pb2.CreateCollectionRequest(collection="partial"))
    good = [_doc(id=f"good.{i}", text=f"document {i}") for i in range(4)]
    bad = [_doc(id="late.ok", text="fine alone"), _doc(id="late.nan", payload=_struct(n=math.nan))]
    error = await _refusal(stub.Upsert(_stream([*good, *bad], "partial", per=2)))
    assert [v.field for v in field_violations(error)] == ["upsert[2].documents[1].payload.n"]
    found = await stub.Search(
        retrieval_pb2.SearchRequest(collection="partial", query="document", top_k=10)
    )
    assert {h.id for h in found.hits} == {d.id for d in good}


@pytest.mark.parametrize(("ids", "field"), [([""], "ids[0]"), (["a", LONG], "ids[1]")])
async def test_bad_deletes_name_the_field(stub, ids, field):
    error = await _refusal(stub.Delete(retrieval_pb2.DeleteRequest(collection="docs", ids=ids)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(error)] == [field]


async def test_a_stream_whose_ids_would_not_fit_its_response_is_cut_before_writing(
    fake_embedder, tmp_path
):
    settings = retrieval_settings(fake_embedder, path=str(tmp_path)).model_copy(
        update={"transport": TransportSettings(max_message_bytes=64 * 1024)}
    )
    async with InProcess() as services:
        served = await services.start("retrieval", settings)
        stub = retrieval_pb2_grpc.RetrievalServiceStub(
            services.channel(served.target, settings=settings)
        )
        await stub.CreateCollection(retrieval_pb2.CreateCollectionRequest(collection="ids"))
        # 4 messages of 64 ids of 250 bytes: ~65 KB of ids, more than a response holds.
        documents = [_doc(id=f"{i:03d}" + "i" * 247, text=f"t{i}") for i in range(256)]
        error = await _refusal(stub.Upsert(_stream(documents, "ids", per=64)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(error)] == ["upsert[2].documents"]
        found = await stub.Search(
            retrieval_pb2.SearchRequest(collection="ids", query="t", top_k=100)
        )
        assert len(found.hits) == 100  # the first two messages' 128 documents stay


async def test_a_delete_matching_most_of_a_collection_needs_allow_bulk(fake_embedder, tmp_path):
    """One must_not on a key no document has matches every document: refused (with how
    many it matched) unless the caller says allow_bulk; a narrow filter goes through."""
    settings = retrieval_settings(
        fake_embedder, path=str(tmp_path), bulk_delete_share=0.5, bulk_delete_min=1
    )
    async with InProcess() as services:
        served = await services.start("retrieval", settings)
        stub = retrieval_pb2_grpc.RetrievalServiceStub(services.channel(served.target))
        await stub.CreateCollection(retrieval_pb2.CreateCollectionRequest(collection="kb"))
        documents = [
            _doc(id=f"d{i}", text=f"t{i}", payload=_struct(m=f"m{i % 4}")) for i in range(8)
        ]
        await stub.Upsert(_stream(documents, "kb"))
        everything = retrieval_pb2.Filter(
            must_not=[retrieval_pb2.Condition(key="missing", keyword="x")]
        )
        error = await _refusal(
            stub.Delete(retrieval_pb2.DeleteRequest(collection="kb", filter=everything))
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(error).reason == "BULK_DELETE" and "8 of the 8" in error.details()
        narrow = retrieval_pb2.Filter(must=[retrieval_pb2.Condition(key="m", keyword="m1")])
        removed = await stub.Delete(retrieval_pb2.DeleteRequest(collection="kb", filter=narrow))
        assert removed.deleted == 2
        removed = await stub.Delete(
            retrieval_pb2.DeleteRequest(collection="kb", filter=everything, allow_bulk=True)
        )
        assert removed.deleted == 6


async def test_each_tenant_writes_its_own_collections_and_reads_the_shared_ones(
    fake_embedder, tmp_path
):
    """x-aimesh-client is the edge key's tenant. A tenant's collection is invisible to
    another tenant; the shared knowledge base (made with no client, as `aimesh ingest`
    does) is searchable by every tenant and writable by none of them."""
    settings = retrieval_settings(fake_embedder, path=str(tmp_path))

    def as_(tenant: str) -> tuple[tuple[str, str], ...]:
        return ((caller.METADATA_KEY, tenant),) if tenant else ()

    async with InProcess() as services:
        served = await services.start("retrieval", settings)
        stub = retrieval_pb2_grpc.RetrievalServiceStub(services.channel(served.target))

        async def create(name: str, tenant: str) -> None:
            request = retrieval_pb2.CreateCollectionRequest(collection=name)
            await stub.CreateCollection(request, metadata=as_(tenant))

        async def upsert(name: str, tenant: str, doc_id: str) -> None:
            documents = _stream([_doc(id=doc_id, text=f"about {doc_id}")], name)
            await stub.Upsert(documents, metadata=as_(tenant))

        async def hits(name: str, tenant: str) -> set[str]:
            request = retrieval_pb2.SearchRequest(collection=name, query="about", top_k=10)
            found = await stub.Search(request, metadata=as_(tenant))
            return {hit.id for hit in found.hits}

        await create("shared", "")
        await upsert("shared", "", "public.doc")
        await create("notes", "acme")
        await upsert("notes", "acme", "acme.secret")
        assert await hits("notes", "acme") == {"acme.secret"}
        missing = await _refusal(hits("notes", "globex"))
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        await create("notes", "globex")  # its own, beside acme's
        await upsert("notes", "globex", "globex.doc")
        assert await hits("notes", "globex") == {"globex.doc"}
        assert await hits("notes", "acme") == {"acme.secret"}
        # The shared collection: every tenant reads it; a write goes to the tenant's own
        # namespace, where it has none.
        assert await hits("shared", "acme") == {"public.doc"}
        refused = await _refusal(upsert("shared", "acme", "defaced"))
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        delete = retrieval_pb2.DeleteRequest(collection="shared", ids=["public.doc"])
        refused = await _refusal(stub.Delete(delete, metadata=as_("acme")))
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        assert await hits("shared", "") == {"public.doc"}
        # A tenant's own collection of a shared name is what its searches read.
        await create("shared", "acme")
        await upsert("shared", "acme", "acme.own")
        assert await hits("shared", "acme") == {"acme.own"}
        assert await hits("shared", "globex") == {"public.doc"}
