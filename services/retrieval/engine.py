"""The knowledge base without its transport: upserts and hybrid searches over the store,
embedding through `Embed` and reranking through `Rerank`, plain Python in and out.

The servicer validates requests and converts messages; this module trusts its inputs,
raises `mesh.failures` exceptions, and never imports grpc. The event loop only routes:
BM25 and fusion run in worker threads (an upsert batch of 256 long documents is ~6 s of
BM25, which on the loop stalled health checks and every other caller), and store calls go
through `StoreCalls` (its own thread, a deadline, a circuit breaker).

A search with rerank looks `rerank_candidates(top_k)` deep, the one place that depth is
decided, and has the reranker pick top_k from those; when the reranker is unavailable
(`RerankUnavailable`) the hits stay in retrieval order and the result's note says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from qdrant_client import models

from mesh.failures import FieldViolation, InvalidInput, NotReady
from services.retrieval import bm25
from services.retrieval.calls import StoreCalls
from services.retrieval.fusion import Hit, reciprocal_rank_fusion
from services.retrieval.settings import RetrievalSettings
from services.retrieval.store import BulkGuard, Found, Incoming, Store
from services.retrieval.tenancy import owned

Mode = Literal["dense", "sparse", "hybrid"]
# One call to the embedder: at most `embed_batch` texts in, their vectors out, in order.
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]
# One call to the reranker: (query, [(id, text)], top_n) -> [(index, score)], best first.
Rerank = Callable[[str, list[tuple[str, str]], int], Awaitable[list[tuple[int, float]]]]

DEFAULT_TOP_K = 10
MIN_RERANK_CANDIDATES = 20
RERANK_DEPTH = 4


def rerank_candidates(top_k: int) -> int:
    """How many retrieval hits a reranked search of top_k gives the reranker."""
    return max(top_k * RERANK_DEPTH, MIN_RERANK_CANDIDATES)


class RerankUnavailable(NotReady):
    """The reranker cannot answer now (down, overloaded, out of time, breaker open); `cause`
    names how, e.g. "UNAVAILABLE". A search answers in retrieval order instead."""

    reason = "RERANK_UNAVAILABLE"

    def __init__(self, cause: str) -> None:
        super().__init__(f"reranking unavailable ({cause})")
        self.cause = cause


@dataclass(frozen=True)
class Upserted:
    received: int
    upserted: int
    unchanged: int
    ids: list[str]
    embed_s: float
    write_s: float


@dataclass(frozen=True)
class Query:
    collection: str
    text: str
    top_k: int = DEFAULT_TOP_K
    mode: Mode | None = None  # None: hybrid when the collection has a sparse index
    query_filter: models.Filter | None = None
    threshold: float | None = None
    with_payload: bool = False
    rerank: bool = False


@dataclass(frozen=True)
class Searched:
    hits: list[Hit]
    embed_s: float
    search_s: float
    rerank_s: float | None = None  # None: no rerank was asked for (or nothing to rerank)
    note: str = ""


class KnowledgeBase:
    def __init__(
        self, settings: RetrievalSettings, calls: StoreCalls, embed: Embed, rerank: Rerank
    ) -> None:
        self.settings = settings
        self.calls = calls
        self._embed = embed
        self._rerank = rerank
        self.store: Store | None = None
        self.dimensions = 0

    async def _in_store(self, method: str, *args: Any) -> Any:
        """Store.<method>(*args) as a call to a dependency; NotReady until the store is
        open (looked up only then: calls arriving during warm-up were INTERNAL errors)."""
        store = self.store
        if store is None:
            raise NotReady("the vector store is still opening")
        return await self.calls.run(getattr(store, method), *args)

    async def open(self, opener: Callable[[], Store]) -> None:
        """Opens the store on its thread, then learns the embedder's dimensions from one
        real call: a collection's vector size is the embedder's."""
        loop = asyncio.get_running_loop()
        self.store = await loop.run_in_executor(self.calls.thread, opener)
        self.dimensions = len((await self.embed(["dimension probe"]))[0])

    async def close(self) -> None:
        """Closes the embedded store cleanly, so the next process can open its folder."""
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(
                self.calls.thread, self.store.client.close
            )

    async def embed(self, texts: list[str]) -> list[list[float]]:
        vectors: list[list[float]] = []
        batch = self.settings.embed_batch
        for start in range(0, len(texts), batch):
            vectors.extend(await self._embed(texts[start : start + batch]))
        return vectors

    async def create(self, collection: str, distance: str, sparse: bool, on_disk: bool) -> bool:
        """True when created; False when it exists with exactly these settings."""
        return await self._in_store(
            "create", collection, self.dimensions, distance, sparse, on_disk
        )

    async def upsert(self, collection: str, batches: AsyncIterator[list[Incoming]]) -> Upserted:
        """Writes each batch's new or changed documents (embedded, with BM25 vectors when
        the collection has a sparse index); a batch the iterator refuses ends the upsert
        with every batch before it written and nothing of it."""
        sparse = (await self._in_store("info", collection)).sparse
        received = upserted = unchanged = 0
        ids: list[str] = []
        embed_s = write_s = 0.0
        async for documents in batches:
            received += len(documents)
            ids.extend(doc.doc_id for doc in documents)
            batch = {doc.doc_id: doc for doc in documents}
            stored = await self._in_store("hashes", collection, list(batch))
            changed = [doc for doc in batch.values() if stored.get(doc.doc_id) != doc.digest]
            unchanged += len(documents) - len(changed)
            if not changed:
                continue
            texts = [doc.text for doc in changed]
            embed_started = time.perf_counter()
            vectors = await self.embed(texts)
            embed_s += time.perf_counter() - embed_started
            bm25_vectors = await asyncio.to_thread(_bm25, texts) if sparse else None
            write_started = time.perf_counter()
            await self._in_store("upsert", collection, changed, vectors, bm25_vectors)
            write_s += time.perf_counter() - write_started
            upserted += len(changed)
        return Upserted(received, upserted, unchanged, ids, embed_s, write_s)

    async def readable(self, collection: str, tenant: str) -> str:
        """The collection a search by `tenant` reads: its own of that name, else the
        shared one (services/retrieval/tenancy.py)."""
        own = owned(collection, tenant)
        if own != collection and await self._in_store("exists", own):
            return own
        return collection

    async def search(self, query: Query) -> Searched:
        info = await self._in_store("info", query.collection)
        mode = query.mode or ("hybrid" if info.sparse else "dense")
        if mode != "dense" and not info.sparse:
            raise InvalidInput(
                [FieldViolation("mode", f"collection {query.collection!r} has no sparse index")]
            )
        wanted = rerank_candidates(query.top_k) if query.rerank else query.top_k
        depth = wanted * self.settings.prefetch_factor if mode == "hybrid" else wanted

        embed_s = 0.0
        ranked: dict[str, list[Found]] = {}
        if mode != "sparse":
            embed_started = time.perf_counter()
            (dense_query,) = await self.embed([query.text])
            embed_s = time.perf_counter() - embed_started
        search_started = time.perf_counter()
        if mode != "sparse":
            ranked["dense"] = await self._in_store(
                "search", query.collection, dense_query, depth, query.query_filter
            )
        if mode != "dense":
            indices, values = await asyncio.to_thread(bm25.query_vector, query.text)
            ranked["sparse"] = []  # a query of stopwords alone has no terms, so no keyword hits
            if indices:
                sparse_query = models.SparseVector(indices=indices, values=values)
                ranked["sparse"] = await self._in_store(
                    "search", query.collection, sparse_query, depth, query.query_filter
                )
        search_s = time.perf_counter() - search_started
        hits = await asyncio.to_thread(self._fused, ranked, mode, wanted, query)
        if not (query.rerank and hits):
            return Searched(hits[: query.top_k], embed_s, search_s)
        rerank_started = time.perf_counter()
        note = ""
        try:
            order = await self._rerank(
                query.text, [(hit.doc_id, hit.text) for hit in hits], query.top_k
            )
            hits = [replace(hits[index], score=score) for index, score in order]
        except RerankUnavailable as error:
            note = f"{error.message}: hits are in retrieval order, best first by {mode} search"
        rerank_s = time.perf_counter() - rerank_started
        return Searched(hits[: query.top_k], embed_s, search_s, rerank_s, note)

    def _fused(
        self, ranked: dict[str, list[Found]], mode: Mode, limit: int, query: Query
    ) -> list[Hit]:
        """Fused, thresholded hits, at most `limit`: runs in a worker thread. With one
        retriever, fusion keeps its order; hybrid scores are the fused ones."""
        hits = []
        for hit in reciprocal_rank_fusion(ranked, self.settings.rrf_k):
            score = hit.score if mode == "hybrid" else hit.sources[mode][1]
            if query.threshold is not None and score < query.threshold:
                continue
            payload = hit.payload if query.with_payload else None
            hits.append(replace(hit, score=score, payload=payload))
            if len(hits) == limit:
                break
        return hits

    async def delete(
        self,
        collection: str,
        ids: list[str],
        query_filter: models.Filter | None,
        *,
        allow_bulk: bool = False,
    ) -> int:
        """Deletes the documents of `ids`, or else those matching the filter (within the
        bulk guard unless `allow_bulk`); how many."""
        await self._in_store("info", collection)
        if ids:
            return await self._in_store("delete_ids", collection, ids)
        guard = None
        if not allow_bulk:
            guard = BulkGuard(self.settings.bulk_delete_share, self.settings.bulk_delete_min)
        return await self._in_store("delete_matching", collection, query_filter, guard)


def _bm25(texts: list[str]) -> list[tuple[list[int], list[float]]]:
    """BM25 document vectors: CPU work, run in a worker thread."""
    return [bm25.document_vector(text) for text in texts]
