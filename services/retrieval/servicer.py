"""The retrieval service's gRPC surface: collections of passages, embedded through the
embedder service, stored and searched in Qdrant.

The event loop only routes: validation with payload conversion and hashing, BM25 and the
fusion of results run in worker threads (an Upsert message of 256 long documents is ~6 s of
BM25, which on the loop stalled health checks and every other caller), and Qdrant calls go
through `StoreCalls` (its own thread, a deadline, a circuit breaker).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
from qdrant_client import QdrantClient, models

from aimesh.common.v1 import common_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from mesh import request_id
from mesh.failures import NotReady
from mesh.health import wait_until_serving
from mesh.registry import discover
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.retrieval import bm25, filters, payloads
from services.retrieval.calls import ServerProbe, StoreCalls
from services.retrieval.fusion import reciprocal_rank_fusion
from services.retrieval.settings import RetrievalSettings, retrieval_settings
from services.retrieval.store import RESERVED_PREFIX, Found, Prepared, Store, content_hash

log = logging.getLogger(__name__)

SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"]
EMBEDDER = embedder_pb2.DESCRIPTOR.services_by_name["EmbedderService"]
COLLECTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_DOCUMENTS_PER_MESSAGE = 256
MAX_ID_BYTES = 256
MAX_TEXT_BYTES = 64 * 1024
MAX_QUERY_BYTES = 8 * 1024
MAX_TOP_K = 100
DEFAULT_TOP_K = 10
MAX_DELETE_IDS = 1000
# Bytes a response spends on one id beyond the id itself: a tag and a length of 1-2 bytes.
ID_OVERHEAD_BYTES = 3
DISTANCES = {
    retrieval_pb2.DISTANCE_UNSPECIFIED: "cosine",
    retrieval_pb2.DISTANCE_COSINE: "cosine",
    retrieval_pb2.DISTANCE_DOT: "dot",
    retrieval_pb2.DISTANCE_EUCLID: "euclid",
}
MODES = frozenset(retrieval_pb2.SearchMode.values())
RETRIEVERS = {"dense": retrieval_pb2.RETRIEVER_DENSE, "sparse": retrieval_pb2.RETRIEVER_SPARSE}

T = TypeVar("T")


def derived_id(text: str) -> str:
    """The id of a document sent without one: the same text always gets the same id."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _check_collection(name: str, violations: Violations, field: str = "collection") -> None:
    violations.check(
        COLLECTION_NAME.fullmatch(name) is not None,
        field,
        "must be 1 to 64 characters of [A-Za-z0-9_-]",
    )


@dataclass(frozen=True)
class _Incoming:
    """One validated document of an Upsert message, hashed."""

    doc_id: str
    text: str
    payload: dict[str, Any]
    digest: str


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, server: MeshServer, settings: RetrievalSettings) -> None:
        self.server = server
        self.settings = settings
        self.store: Store | None = None
        self.dimensions = 0
        self.calls = StoreCalls(
            _display(settings.url) if settings.url else "embedded",
            settings.timeout_s,
            server.settings.client.breaker,
        )
        # An Upsert's response lists every id of its stream, and must fit in one message.
        self.max_stream_id_bytes = server.settings.transport.max_message_bytes // 2
        self.embedder_target = settings.embedder or server.settings.target_of(
            "embedder", discover()["embedder"].default_port
        )

    async def _in_store(self, method: str, *args: Any) -> Any:
        """Store.<method>(*args) as a call to a dependency; NotReady until the store is
        open (looked up only then: calls arriving during warm-up were INTERNAL errors)."""
        store = self.store
        if store is None:
            raise NotReady("the vector store is still opening")
        return await self.calls.run(getattr(store, method), *args)

    async def embed(self, texts: list[str]) -> list[list[float]]:
        stub = embedder_pb2_grpc.EmbedderServiceStub(
            self.server.channels.get(self.embedder_target, EMBEDDER)
        )
        vectors: list[list[float]] = []
        batch = self.settings.embed_batch
        for start in range(0, len(texts), batch):
            response = await stub.Embed(
                embedder_pb2.EmbedRequest(inputs=texts[start : start + batch], truncate=True)
            )
            vectors.extend(list(e.values) for e in response.embeddings)
        return vectors

    # ---- CreateCollection ----

    async def CreateCollection(
        self,
        request: retrieval_pb2.CreateCollectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> retrieval_pb2.CreateCollectionResponse:
        started = time.perf_counter()
        request_id.ensure(request.request_id)
        violations = Violations()
        _check_collection(request.collection, violations)
        violations.check(
            request.vector_size in (0, self.dimensions),
            "vector_size",
            f"must be 0 or the embedder's {self.dimensions} dimensions, got {request.vector_size}",
        )
        violations.check(request.distance in DISTANCES, "distance", "is not a known distance")
        violations.raise_if_any()
        created = await self._in_store(
            "create",
            request.collection,
            self.dimensions,
            DISTANCES[request.distance],
            request.sparse_enabled,
            request.on_disk,
        )
        return retrieval_pb2.CreateCollectionResponse(
            created=created,
            vector_size=self.dimensions,
            timing=common_pb2.Timing(total_ns=int((time.perf_counter() - started) * 1e9)),
        )

    # ---- Upsert ----

    async def Upsert(
        self,
        request_iterator: AsyncIterator[retrieval_pb2.UpsertRequest],
        context: grpc.aio.ServicerContext,
    ) -> retrieval_pb2.UpsertResponse:
        started = time.perf_counter()
        collection = ""
        sparse = False
        received = upserted = unchanged = id_bytes = 0
        ids: list[str] = []
        embed_s = write_s = 0.0
        index = -1
        async for index, message in _enumerate(request_iterator):
            if index == 0:
                request_id.check(message.request_id, "upsert[0].request_id")
                request_id.ensure(message.request_id)
                violations = Violations()
                _check_collection(message.collection, violations, "upsert[0].collection")
                violations.raise_if_any()
                collection = message.collection
                sparse = (await self._in_store("info", collection)).sparse
            documents = await asyncio.to_thread(self._validated, message, index, collection)
            id_bytes += sum(len(doc.doc_id.encode()) + ID_OVERHEAD_BYTES for doc in documents)
            violations = Violations()
            violations.check(
                id_bytes <= self.max_stream_id_bytes,
                f"upsert[{index}].documents",
                f"the stream's ids would pass {self.max_stream_id_bytes} bytes, more than its "
                "response may carry: send the rest in another Upsert",
            )
            violations.raise_if_any()
            received += len(documents)
            ids.extend(doc.doc_id for doc in documents)
            batch = {doc.doc_id: doc for doc in documents}
            stored = await self._in_store("hashes", collection, list(batch))
            changed = [doc for doc in batch.values() if stored.get(doc.doc_id) != doc.digest]
            unchanged += len(documents) - len(changed)
            if not changed:
                continue
            embed_started = time.perf_counter()
            vectors = await self.embed([doc.text for doc in changed])
            embed_s += time.perf_counter() - embed_started
            prepared = await asyncio.to_thread(_prepare, changed, vectors, sparse)
            write_started = time.perf_counter()
            await self._in_store("upsert", collection, prepared)
            write_s += time.perf_counter() - write_started
            upserted += len(prepared)
        if index < 0:
            violations = Violations()
            violations.add("upsert", "the stream carried no message")
            violations.raise_if_any()
        return retrieval_pb2.UpsertResponse(
            received=received,
            upserted=upserted,
            unchanged=unchanged,
            ids=ids,
            timing=common_pb2.Timing(
                stages=[
                    stage("embed", embed_s, common_pb2.STAGE_KIND_CALL),
                    stage("write", write_s, common_pb2.STAGE_KIND_COMPUTE),
                ],
                total_ns=int((time.perf_counter() - started) * 1e9),
            ),
        )

    def _validated(
        self, message: retrieval_pb2.UpsertRequest, index: int, collection: str
    ) -> list[_Incoming]:
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
            doc_id = doc.id or derived_id(doc.text)
            documents.append(_Incoming(doc_id, doc.text, payload, content_hash(doc.text, payload)))
        violations.raise_if_any()
        return documents

    # ---- Search ----

    async def Search(
        self,
        request: retrieval_pb2.SearchRequest,
        context: grpc.aio.ServicerContext,
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
        info = await self._in_store("info", request.collection)
        mode = request.mode or (
            retrieval_pb2.SEARCH_MODE_HYBRID if info.sparse else retrieval_pb2.SEARCH_MODE_DENSE
        )
        if mode != retrieval_pb2.SEARCH_MODE_DENSE and not info.sparse:
            violations.add("mode", f"collection {request.collection!r} has no sparse index")
            violations.raise_if_any()
        top_k = request.top_k if request.HasField("top_k") else DEFAULT_TOP_K
        depth = (
            top_k * self.settings.prefetch_factor
            if mode == retrieval_pb2.SEARCH_MODE_HYBRID
            else top_k
        )

        embed_s = 0.0
        ranked: dict[str, list[Found]] = {}
        if mode != retrieval_pb2.SEARCH_MODE_SPARSE:
            embed_started = time.perf_counter()
            (dense_query,) = await self.embed([request.query])
            embed_s = time.perf_counter() - embed_started
        search_started = time.perf_counter()
        if mode != retrieval_pb2.SEARCH_MODE_SPARSE:
            ranked["dense"] = await self._in_store(
                "search", request.collection, dense_query, "dense", depth, query_filter
            )
        if mode != retrieval_pb2.SEARCH_MODE_DENSE:
            indices, values = await asyncio.to_thread(bm25.query_vector, request.query)
            ranked["sparse"] = []  # a query of stopwords alone has no terms, so no keyword hits
            if indices:
                ranked["sparse"] = await self._in_store(
                    "search",
                    request.collection,
                    models.SparseVector(indices=indices, values=values),
                    "bm25",
                    depth,
                    query_filter,
                )
        search_s = time.perf_counter() - search_started
        threshold = request.score_threshold if request.HasField("score_threshold") else None
        hits = await asyncio.to_thread(
            self._hits, ranked, mode, top_k, threshold, request.with_payload
        )
        return retrieval_pb2.SearchResponse(
            hits=hits,
            timing=common_pb2.Timing(
                stages=[
                    stage("embed", embed_s, common_pb2.STAGE_KIND_CALL),
                    stage("search", search_s, common_pb2.STAGE_KIND_COMPUTE),
                ],
                total_ns=int((time.perf_counter() - started) * 1e9),
            ),
        )

    def _hits(
        self,
        ranked: dict[str, list[Found]],
        mode: int,
        top_k: int,
        threshold: float | None,
        with_payload: bool,
    ) -> list[retrieval_pb2.Hit]:
        """Fused, thresholded hits as messages, payloads converted: runs in a worker thread.
        With one retriever, fusion keeps its order; hybrid scores are the fused ones."""
        hits = []
        for entry in reciprocal_rank_fusion(ranked, self.settings.rrf_k):
            score = entry.score if mode == retrieval_pb2.SEARCH_MODE_HYBRID else entry.hit.score
            if threshold is not None and score < threshold:
                continue
            hits.append(
                retrieval_pb2.Hit(
                    id=entry.hit.doc_id,
                    score=score,
                    text=entry.hit.text,
                    sources=[
                        retrieval_pb2.HitSource(retriever=RETRIEVERS[name], rank=rank, score=s)
                        for name, (rank, s) in entry.sources.items()
                    ],
                    payload=entry.hit.payload if with_payload else None,
                )
            )
            if len(hits) == top_k:
                break
        return hits

    # ---- Delete ----

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
        await self._in_store("info", request.collection)
        if request.ids:
            deleted = await self._in_store("delete_ids", request.collection, list(request.ids))
        else:
            deleted = await self._in_store("delete_matching", request.collection, query_filter)
        return retrieval_pb2.DeleteResponse(
            deleted=deleted,
            timing=common_pb2.Timing(total_ns=int((time.perf_counter() - started) * 1e9)),
        )


def _prepare(changed: list[_Incoming], vectors: list[list[float]], sparse: bool) -> list[Prepared]:
    """The points to write, BM25 vectors included: CPU work, run in a worker thread."""
    return [
        Prepared(
            doc_id=doc.doc_id,
            text=doc.text,
            payload=doc.payload,
            digest=doc.digest,
            dense=vector,
            sparse=bm25.document_vector(doc.text) if sparse else None,
        )
        for doc, vector in zip(changed, vectors, strict=True)
    ]


async def _enumerate(iterator: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    index = 0
    async for item in iterator:
        yield index, item
        index += 1


def _display(url: str) -> str:
    """The URL without credentials or path, fit for error messages."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def open_store(settings: RetrievalSettings, cache_dir: Path) -> Store:
    """Opens without contacting a server: a Qdrant server that is down only delays readiness."""
    if settings.url:
        client = QdrantClient(
            url=settings.url, api_key=settings.api_key, timeout=math.ceil(settings.timeout_s)
        )
        return Store(client, local=False)
    path = settings.path or cache_dir / "qdrant"
    path.mkdir(parents=True, exist_ok=True)
    return Store(QdrantClient(path=str(path)), local=True)


async def setup(server: MeshServer) -> None:
    settings = retrieval_settings(server.settings)
    servicer = RetrievalServicer(server, settings)
    server.add_service(retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server, servicer, SERVICE)
    # A server's readiness is the service's; the embedded store lives in this process.
    probe = ServerProbe(settings.url, settings.api_key) if settings.url else None
    if probe is not None:
        server.add_readiness_probe(probe.answers)

    async def warm_up() -> None:
        loop = asyncio.get_running_loop()
        servicer.store = await loop.run_in_executor(
            servicer.calls.thread, open_store, settings, server.settings.cache_dir
        )
        # Ready only once documents can be embedded: the collection's vector size is the
        # embedder's, learnt from one real call.
        while not await wait_until_serving(servicer.embedder_target, "embedder", timeout_s=60):
            log.warning("waiting for the embedder", extra={"target": servicer.embedder_target})
        servicer.dimensions = len((await servicer.embed(["dimension probe"]))[0])
        if probe is not None:
            await probe.wait(servicer.calls.where)

    async def shut_down() -> None:
        """Closes the embedded store cleanly, so the next process can open its folder."""
        if probe is not None:
            await probe.close()
        if servicer.store is not None:
            await asyncio.get_running_loop().run_in_executor(
                servicer.calls.thread, servicer.store.client.close
            )
        await asyncio.to_thread(servicer.calls.close)

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
