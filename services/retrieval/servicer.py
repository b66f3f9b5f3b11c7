"""The retrieval service's gRPC surface: collections of passages, embedded through the
embedder service, stored and searched in Qdrant."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
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
from services.retrieval import bm25, filters
from services.retrieval.fusion import reciprocal_rank_fusion
from services.retrieval.settings import RetrievalSettings, retrieval_settings
from services.retrieval.store import RESERVED_PREFIX, Prepared, Store, content_hash

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
DISTANCES = {
    retrieval_pb2.DISTANCE_UNSPECIFIED: "cosine",
    retrieval_pb2.DISTANCE_COSINE: "cosine",
    retrieval_pb2.DISTANCE_DOT: "dot",
    retrieval_pb2.DISTANCE_EUCLID: "euclid",
}
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


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, server: MeshServer, settings: RetrievalSettings) -> None:
        self.server = server
        self.settings = settings
        self.store: Store | None = None
        self.dimensions = 0
        # Qdrant's embedded mode is single-writer: one thread does every store call.
        self.store_thread = ThreadPoolExecutor(1, thread_name_prefix="qdrant")
        self.embedder_target = settings.embedder or server.settings.target_of(
            "embedder", discover()["embedder"].default_port
        )

    async def _in_store(self, work: Callable[..., T], *args: Any) -> T:
        if self.store is None:
            raise NotReady("the vector store is still opening")
        return await asyncio.get_running_loop().run_in_executor(self.store_thread, work, *args)

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
        self, request: retrieval_pb2.CreateCollectionRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.CreateCollectionResponse:
        started = time.perf_counter()
        violations = Violations()
        _check_collection(request.collection, violations)
        violations.check(
            request.vector_size in (0, self.dimensions),
            "vector_size",
            f"must be 0 or the embedder's {self.dimensions} dimensions, got {request.vector_size}",
        )
        violations.check(request.distance in DISTANCES, "distance", "is not a known distance")
        violations.raise_if_any()
        store = self.store
        created = await self._in_store(
            lambda: store.create(
                request.collection,
                self.dimensions,
                DISTANCES[request.distance],
                request.sparse_enabled,
                request.on_disk,
            )
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
        received = upserted = unchanged = 0
        ids: list[str] = []
        embed_s = write_s = 0.0
        index = -1
        async for index, message in _enumerate(request_iterator):
            if index == 0:
                request_id.ensure(message.request_id)
                violations = Violations()
                _check_collection(message.collection, violations, "upsert[0].collection")
                violations.raise_if_any()
                collection = message.collection
                sparse = (await self._in_store(self.store.info, collection)).sparse
            documents = self._validated(message, index, collection)
            received += len(documents)
            ids.extend(doc_id for doc_id, _, _ in documents)
            batch = {doc_id: (text, payload) for doc_id, text, payload in documents}
            stored = await self._in_store(self.store.hashes, collection, list(batch))
            digests = {d: content_hash(t, p) for d, (t, p) in batch.items()}
            changed = [d for d in batch if stored.get(d) != digests[d]]
            unchanged += len(documents) - len(changed)
            if not changed:
                continue
            embed_started = time.perf_counter()
            vectors = await self.embed([batch[d][0] for d in changed])
            embed_s += time.perf_counter() - embed_started
            prepared = [
                Prepared(
                    doc_id=d,
                    text=batch[d][0],
                    payload=batch[d][1],
                    digest=digests[d],
                    dense=vector,
                    sparse=bm25.document_vector(batch[d][0]) if sparse else None,
                )
                for d, vector in zip(changed, vectors, strict=True)
            ]
            write_started = time.perf_counter()
            await self._in_store(self.store.upsert, collection, prepared)
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
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, text, payload) of every document in one stream message, or InvalidInput."""
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
        documents = []
        for i, doc in enumerate(message.documents):
            where = f"{field}.documents[{i}]"
            violations.check(bool(doc.text), f"{where}.text", "must not be empty")
            violations.max_length(doc.text.encode(), f"{where}.text", MAX_TEXT_BYTES)
            violations.max_length(doc.id.encode(), f"{where}.id", MAX_ID_BYTES)
            payload = json_format.MessageToDict(doc.payload)
            reserved = [k for k in payload if k.startswith(RESERVED_PREFIX)]
            violations.check(
                not reserved, f"{where}.payload", f"keys {reserved} use the reserved prefix"
            )
            documents.append((doc.id or derived_id(doc.text), doc.text, payload))
        violations.raise_if_any()
        return documents

    # ---- Search ----

    async def Search(
        self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.SearchResponse:
        started = time.perf_counter()
        violations = Violations()
        _check_collection(request.collection, violations)
        violations.check(bool(request.query.strip()), "query", "must not be empty")
        violations.max_length(request.query.encode(), "query", MAX_QUERY_BYTES)
        if request.HasField("top_k"):
            violations.in_range(request.top_k, "top_k", 1, MAX_TOP_K)
        if request.HasField("score_threshold"):
            violations.in_range(request.score_threshold, "score_threshold", -1e9, 1e9)
        query_filter = filters.to_qdrant(request.filter, "filter", violations)
        violations.raise_if_any()
        info = await self._in_store(self.store.info, request.collection)
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
        ranked = {}
        if mode != retrieval_pb2.SEARCH_MODE_SPARSE:
            embed_started = time.perf_counter()
            (dense_query,) = await self.embed([request.query])
            embed_s = time.perf_counter() - embed_started
        search_started = time.perf_counter()
        if mode != retrieval_pb2.SEARCH_MODE_SPARSE:
            ranked["dense"] = await self._in_store(
                self.store.search, request.collection, dense_query, "dense", depth, query_filter
            )
        if mode != retrieval_pb2.SEARCH_MODE_DENSE:
            indices, values = bm25.query_vector(request.query)
            ranked["sparse"] = await self._in_store(
                self.store.search,
                request.collection,
                models.SparseVector(indices=indices, values=values),
                "bm25",
                depth,
                query_filter,
            )
        search_s = time.perf_counter() - search_started
        # With one retriever, fusion keeps its order; hybrid scores are the fused ones.
        fused = reciprocal_rank_fusion(ranked, self.settings.rrf_k)
        hits = []
        for entry in fused:
            score = entry.score if mode == retrieval_pb2.SEARCH_MODE_HYBRID else entry.hit.score
            if request.HasField("score_threshold") and score < request.score_threshold:
                continue
            hit = retrieval_pb2.Hit(
                id=entry.hit.doc_id,
                score=score,
                text=entry.hit.text,
                sources=[
                    retrieval_pb2.HitSource(retriever=RETRIEVERS[name], rank=rank, score=s)
                    for name, (rank, s) in entry.sources.items()
                ],
                payload=entry.hit.payload if request.with_payload else None,
            )
            hits.append(hit)
            if len(hits) == top_k:
                break
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

    # ---- Delete ----

    async def Delete(
        self, request: retrieval_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.DeleteResponse:
        started = time.perf_counter()
        violations = Violations()
        _check_collection(request.collection, violations)
        query_filter = filters.to_qdrant(request.filter, "filter", violations)
        violations.check(
            bool(request.ids) != (query_filter is not None),
            "ids",
            "exactly one of ids and a non-empty filter must be given",
        )
        violations.check(
            len(request.ids) <= MAX_DELETE_IDS, "ids", f"at most {MAX_DELETE_IDS} per call"
        )
        violations.raise_if_any()
        await self._in_store(self.store.info, request.collection)
        if request.ids:
            deleted = await self._in_store(
                self.store.delete_ids, request.collection, list(request.ids)
            )
        else:
            deleted = await self._in_store(
                self.store.delete_matching, request.collection, query_filter
            )
        return retrieval_pb2.DeleteResponse(
            deleted=deleted,
            timing=common_pb2.Timing(total_ns=int((time.perf_counter() - started) * 1e9)),
        )


async def _enumerate(iterator: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    index = 0
    async for item in iterator:
        yield index, item
        index += 1


def open_store(settings: RetrievalSettings, cache_dir) -> Store:
    if settings.url:
        return Store(QdrantClient(url=settings.url, api_key=settings.api_key), local=False)
    path = settings.path or cache_dir / "qdrant"
    path.mkdir(parents=True, exist_ok=True)
    return Store(QdrantClient(path=str(path)), local=True)


async def setup(server: MeshServer) -> None:
    settings = retrieval_settings(server.settings)
    servicer = RetrievalServicer(server, settings)
    server.add_service(retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server, servicer, SERVICE)

    async def warm_up() -> None:
        loop = asyncio.get_running_loop()
        servicer.store = await loop.run_in_executor(
            servicer.store_thread, open_store, settings, server.settings.cache_dir
        )
        # Ready only once documents can be embedded: the collection's vector size is the
        # embedder's, learnt from one real call.
        while not await wait_until_serving(servicer.embedder_target, "embedder", timeout_s=60):
            log.warning("waiting for the embedder", extra={"target": servicer.embedder_target})
        servicer.dimensions = len((await servicer.embed(["dimension probe"]))[0])

    async def shut_down() -> None:
        """Closes the embedded store cleanly, so the next process can open its folder."""
        if servicer.store is not None:
            await servicer._in_store(servicer.store.client.close)
        servicer.store_thread.shutdown(wait=True)

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
