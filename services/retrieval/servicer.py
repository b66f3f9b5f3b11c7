"""The retrieval service's gRPC surface: validate, convert messages, call the knowledge
base (services/retrieval/engine.py), convert its results back.

The embedder and the rerank service are declared dependencies, called through the mesh
channels `MeshServer.channel_to` hands out; a rerank that is down, overloaded, out of time
or behind an open breaker becomes `RerankUnavailable`, which the engine answers in
retrieval order. Payload conversion and hashing of an Upsert message, and hits turned
into messages, run in worker threads: a message of 256 documents is too much work for
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from mesh import caller, request_id
from mesh.failures import FieldViolation, InvalidInput
from mesh.health import wait_until_serving
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.retrieval import filters, payloads
from services.retrieval.calls import ServerProbe, StoreCalls, display
from services.retrieval.engine import (
    DEFAULT_TOP_K,
    Hit,
    KnowledgeBase,
    Mode,
    Query,
    RerankUnavailable,
)
from services.retrieval.settings import RetrievalSettings
from services.retrieval.store import RESERVED_PREFIX, Incoming, open_store
from services.retrieval.tenancy import owned

log = logging.getLogger(__name__)

SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"]
EMBEDDER = embedder_pb2.DESCRIPTOR.services_by_name["EmbedderService"]
RERANK = rerank_pb2.DESCRIPTOR.services_by_name["RerankService"]
COLLECTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_DOCUMENTS_PER_MESSAGE = 256
MAX_ID_BYTES = 256
MAX_TEXT_BYTES = 64 * 1024
MAX_QUERY_BYTES = 8 * 1024
MAX_TOP_K = 100
MAX_DELETE_IDS = 1000
# Bytes a response spends on one id beyond the id itself: a tag and a length of 1-2 bytes.
ID_OVERHEAD_BYTES = 3
DISTANCES = {
    retrieval_pb2.DISTANCE_UNSPECIFIED: "cosine",
    retrieval_pb2.DISTANCE_COSINE: "cosine",
    retrieval_pb2.DISTANCE_DOT: "dot",
    retrieval_pb2.DISTANCE_EUCLID: "euclid",
}
MODES: dict[int, Mode | None] = {
    retrieval_pb2.SEARCH_MODE_UNSPECIFIED: None,
    retrieval_pb2.SEARCH_MODE_DENSE: "dense",
    retrieval_pb2.SEARCH_MODE_SPARSE: "sparse",
    retrieval_pb2.SEARCH_MODE_HYBRID: "hybrid",
}
RETRIEVERS = {"dense": retrieval_pb2.RETRIEVER_DENSE, "sparse": retrieval_pb2.RETRIEVER_SPARSE}
# Rerank failures that mean "not now" rather than "wrong request": the search then answers
# in retrieval order. An open breaker fails locally with UNAVAILABLE.
RERANK_DOWN = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def _check_collection(name: str, violations: Violations, field: str = "collection") -> None:
    violations.check(
        COLLECTION_NAME.fullmatch(name) is not None,
        field,
        "must be 1 to 64 characters of [A-Za-z0-9_-]",
    )


def _timing(started: float, *stages: common_pb2.Stage) -> common_pb2.Timing:
    return common_pb2.Timing(stages=stages, total_ns=int((time.perf_counter() - started) * 1e9))


class Dependencies:
    """The embedder and the rerank service as the engine calls them, through the mesh
    channels (deadline, breaker, retries) MeshServer.channel_to hands out."""

    def __init__(self, server: MeshServer) -> None:
        self.server = server

    async def embed(self, texts: list[str]) -> list[list[float]]:
        stub = embedder_pb2_grpc.EmbedderServiceStub(self.server.channel_to("embedder", EMBEDDER))
        response = await stub.Embed(embedder_pb2.EmbedRequest(inputs=texts, truncate=True))
        return [list(e.values) for e in response.embeddings]

    async def rerank(
        self, query: str, documents: list[tuple[str, str]], top_n: int
    ) -> list[tuple[int, float]]:
        """Candidates are cut at the scorer's token limit rather than refused: ingested
        passages may run past it, and ranking on their first 512 tokens beats failing."""
        stub = rerank_pb2_grpc.RerankServiceStub(self.server.channel_to("rerank", RERANK))
        try:
            ranked = await stub.Rerank(
                rerank_pb2.RerankRequest(
                    query=query,
                    documents=[rerank_pb2.Document(id=i, text=t) for i, t in documents],
                    top_n=top_n,
                    truncate=True,
                )
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in RERANK_DOWN:
                raise RerankUnavailable(error.code().name) from error
            raise
        return [(result.index, result.score) for result in ranked.results]


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, engine: KnowledgeBase, max_message_bytes: int) -> None:
        self.engine = engine
        # An Upsert's response lists every id of its stream, and must fit in one message.
        self.max_stream_id_bytes = max_message_bytes // 2

    async def CreateCollection(
        self, request: retrieval_pb2.CreateCollectionRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.CreateCollectionResponse:
        started = time.perf_counter()
        request_id.ensure(request.request_id)
        dimensions = self.engine.dimensions
        violations = Violations()
        _check_collection(request.collection, violations)
        violations.check(
            request.vector_size in (0, dimensions),
            "vector_size",
            f"must be 0 or the embedder's {dimensions} dimensions, got {request.vector_size}",
        )
        violations.check(request.distance in DISTANCES, "distance", "is not a known distance")
        violations.raise_if_any()
        created = await self.engine.create(
            owned(request.collection, caller.current()),
            DISTANCES[request.distance],
            request.sparse_enabled,
            request.on_disk,
        )
        return retrieval_pb2.CreateCollectionResponse(
            created=created, vector_size=dimensions, timing=_timing(started)
        )

    async def Upsert(
        self,
        request_iterator: AsyncIterator[retrieval_pb2.UpsertRequest],
        context: grpc.aio.ServicerContext,
    ) -> retrieval_pb2.UpsertResponse:
        started = time.perf_counter()
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None:
            raise InvalidInput([FieldViolation("upsert", "the stream carried no message")])
        request_id.check(first.request_id, "upsert[0].request_id")
        request_id.ensure(first.request_id)
        violations = Violations()
        _check_collection(first.collection, violations, "upsert[0].collection")
        violations.raise_if_any()
        collection = first.collection
        stored_as = owned(collection, caller.current())

        async def batches() -> AsyncIterator[list[Incoming]]:
            """Each message's documents, validated; refuses one whose ids would not fit in
            the response, before any of its documents is written."""
            id_bytes = 0
            index, message = 0, first
            while message is not None:
                documents = await asyncio.to_thread(_validated, message, index, collection)
                id_bytes += sum(len(d.doc_id.encode()) + ID_OVERHEAD_BYTES for d in documents)
                violations = Violations()
                violations.check(
                    id_bytes <= self.max_stream_id_bytes,
                    f"upsert[{index}].documents",
                    f"the stream's ids would pass {self.max_stream_id_bytes} bytes, more than "
                    "its response may carry: send the rest in another Upsert",
                )
                violations.raise_if_any()
                yield documents
                index, message = index + 1, await anext(messages, None)

        done = await self.engine.upsert(stored_as, batches())
        return retrieval_pb2.UpsertResponse(
            received=done.received,
            upserted=done.upserted,
            unchanged=done.unchanged,
            ids=done.ids,
            timing=_timing(
                started,
                stage("embed", done.embed_s, common_pb2.STAGE_KIND_CALL),
                stage("write", done.write_s, common_pb2.STAGE_KIND_COMPUTE),
            ),
        )

    async def Search(
        self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.SearchResponse:
        started = time.perf_counter()
        request_id.ensure(request.request_id)
        violations = Violations()
        _check_collection(request.collection, violations)
        if violations.max_length(request.query.encode(), "query", MAX_QUERY_BYTES):
            violations.check(bool(request.query.strip()), "query", "must not be empty")
        if request.HasField("top_k"):
            violations.in_range(request.top_k, "top_k", 1, MAX_TOP_K)
        if request.HasField("score_threshold"):
            violations.in_range(request.score_threshold, "score_threshold", -1e9, 1e9)
        violations.check(request.mode in MODES, "mode", "is not a known search mode")
        query_filter = filters.to_qdrant(request.filter, "filter", violations)
        violations.raise_if_any()
        found = await self.engine.search(
            Query(
                collection=await self.engine.readable(request.collection, caller.current()),
                text=request.query,
                top_k=request.top_k if request.HasField("top_k") else DEFAULT_TOP_K,
                mode=MODES[request.mode],
                query_filter=query_filter,
                threshold=request.score_threshold if request.HasField("score_threshold") else None,
                with_payload=request.with_payload,
                rerank=request.rerank,
            )
        )
        stages = [
            stage("embed", found.embed_s, common_pb2.STAGE_KIND_CALL),
            stage("search", found.search_s, common_pb2.STAGE_KIND_COMPUTE),
        ]
        if found.rerank_s is not None:
            stages.append(stage("rerank", found.rerank_s, common_pb2.STAGE_KIND_CALL))
        return retrieval_pb2.SearchResponse(
            hits=await asyncio.to_thread(_hit_messages, found.hits),
            note=found.note,
            timing=_timing(started, *stages),
        )

    async def Delete(
        self, request: retrieval_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.DeleteResponse:
        started = time.perf_counter()
        request_id.ensure(request.request_id)
        violations = Violations()
        _check_collection(request.collection, violations)
        query_filter = filters.to_qdrant(request.filter, "filter", violations)
        has_filter = any((request.filter.must, request.filter.should, request.filter.must_not))
        violations.check(
            bool(request.ids) != has_filter,
            "ids",
            "exactly one of ids and a non-empty filter must be given",
        )
        if violations.check(
            len(request.ids) <= MAX_DELETE_IDS, "ids", f"at most {MAX_DELETE_IDS} per call"
        ):
            for i, doc_id in enumerate(request.ids):
                if violations.check(bool(doc_id), f"ids[{i}]", "must not be empty"):
                    violations.max_length(doc_id.encode(), f"ids[{i}]", MAX_ID_BYTES)
        violations.raise_if_any()
        deleted = await self.engine.delete(
            owned(request.collection, caller.current()),
            list(request.ids),
            query_filter,
            allow_bulk=request.allow_bulk,
        )
        return retrieval_pb2.DeleteResponse(deleted=deleted, timing=_timing(started))


def _validated(message: retrieval_pb2.UpsertRequest, index: int, collection: str) -> list[Incoming]:
    """Every document of one stream message, checked, converted and hashed, or
    InvalidInput. CPU work in proportion to the message: runs in a worker thread."""
    field = f"upsert[{index}]"
    violations = Violations()
    violations.check(
        message.collection in ("", collection),
        f"{field}.collection",
        f"must be empty or {collection!r} (the stream's first collection)",
    )
    violations.check(
        0 < len(message.documents) <= MAX_DOCUMENTS_PER_MESSAGE,
        f"{field}.documents",
        f"must hold 1 to {MAX_DOCUMENTS_PER_MESSAGE} documents, got {len(message.documents)}",
    )
    violations.raise_if_any()
    documents = []
    for i, doc in enumerate(message.documents):
        where = f"{field}.documents[{i}]"
        violations.check(bool(doc.text), f"{where}.text", "must not be empty")
        violations.max_length(doc.text.encode(), f"{where}.text", MAX_TEXT_BYTES)
        violations.max_length(doc.id.encode(), f"{where}.id", MAX_ID_BYTES)
        payload = payloads.to_json(doc.payload, f"{where}.payload", violations)
        reserved = [k[:64] for k in payload if k.startswith(RESERVED_PREFIX)]
        violations.check(
            not reserved, f"{where}.payload", f"keys {reserved} use the reserved prefix"
        )
        if violations:
            # Refused: later documents go unchecked, since a status names only a few
            # fields, and a message of 256 payloads of NaNs would be a million violations.
            break
        documents.append(Incoming.of(doc.id, doc.text, payload))
    violations.raise_if_any()
    return documents


def _hit_messages(hits: list[Hit]) -> list[retrieval_pb2.Hit]:
    """Hits as messages, payloads converted: runs in a worker thread."""
    return [
        retrieval_pb2.Hit(
            id=hit.doc_id,
            score=hit.score,
            text=hit.text,
            sources=[
                retrieval_pb2.HitSource(retriever=RETRIEVERS[name], rank=rank, score=score)
                for name, (rank, score) in hit.sources.items()
            ],
            payload=hit.payload,
        )
        for hit in hits
    ]


async def setup(server: MeshServer) -> None:
    settings = server.options_as(RetrievalSettings)
    calls = StoreCalls(
        display(settings.url) if settings.url else "embedded",
        settings.timeout_s,
        server.settings.client.breaker,
        server.executor("qdrant"),
    )
    dependencies = Dependencies(server)
    engine = KnowledgeBase(settings, calls, dependencies.embed, dependencies.rerank)
    servicer = RetrievalServicer(engine, server.settings.transport.max_message_bytes)
    server.add_service(retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server, servicer, SERVICE)
    # A server's readiness is the service's; the embedded store lives in this process.
    probe = ServerProbe(settings.url, settings.qdrant_key()) if settings.url else None
    if probe is not None:
        server.add_readiness_probe(probe.answers)

    async def warm_up() -> None:
        # Ready only once documents can be embedded: the collection's vector size is the
        # embedder's, learnt from one real call when the store opens.
        # Around the mesh channel: an embedder still starting must not open its breaker.
        embedder = server.dependency_target("embedder")
        while not await wait_until_serving(
            embedder, "embedder", timeout_s=60, tls=server.settings.tls
        ):
            log.warning("waiting for the embedder")
        await engine.open(lambda: open_store(settings, server.settings.cache_dir))
        if probe is not None:
            await probe.wait(calls.where)

    async def shut_down() -> None:
        if probe is not None:
            await probe.close()
        await engine.close()

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
