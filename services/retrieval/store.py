"""Qdrant behind the few operations retrieval needs; no grpc here.

Each document is one Qdrant point: a dense vector ("dense"), a BM25 sparse vector ("bm25",
IDF applied by Qdrant) when the collection has one, and the caller's payload plus reserved
keys: its aimesh id (Qdrant ids must be integers or UUIDs, so the point id is a UUID5 of
it), its text, and a hash of text and payload that lets a re-upsert skip what did not
change. Calls are synchronous: the engine runs them on one thread of their own, which
also serialises access to the embedded store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdrant_client import QdrantClient, models

from mesh.failures import AlreadyExists, Conflict, NotFound
from services.retrieval.settings import RetrievalSettings

log = logging.getLogger(__name__)

DENSE = "dense"
SPARSE = "bm25"
ID_KEY = "_aimesh_id"
TEXT_KEY = "_aimesh_text"
HASH_KEY = "_aimesh_hash"
RESERVED_PREFIX = "_aimesh"
# Qdrant's embedded mode is brute force; past this many points, searches slow down enough
# that a server (or cluster) is the better home (docs/benchmarks.md has the curve).
LOCAL_MODE_POINTS_WARNING = 20_000

_NAMESPACE = uuid.UUID("6f1c2b0e-7d5c-4a43-9b8e-3a8f6b0b2c11")


def point_id(doc_id: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, doc_id))


def content_hash(text: str, payload: dict[str, Any]) -> str:
    blob = json.dumps([text, payload], sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def derived_id(text: str) -> str:
    """The id of a document sent without one: the same text always gets the same id."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CollectionInfo:
    vector_size: int
    distance: str
    sparse: bool
    on_disk: bool


@dataclass(frozen=True)
class Incoming:
    """One validated document of an upsert, hashed."""

    doc_id: str
    text: str
    payload: dict[str, Any]
    digest: str

    @classmethod
    def of(cls, doc_id: str, text: str, payload: dict[str, Any]) -> Incoming:
        """With its id derived from the text when empty: CPU work, so call it in a thread."""
        doc_id = doc_id or derived_id(text)
        return cls(doc_id, text, payload, content_hash(text, payload))


@dataclass(frozen=True)
class Found:
    doc_id: str
    score: float
    text: str
    payload: dict[str, Any]


class Store:
    def __init__(self, client: QdrantClient, local: bool) -> None:
        self.client = client
        self.local = local

    def exists(self, collection: str) -> bool:
        return self.client.collection_exists(collection)

    def info(self, collection: str) -> CollectionInfo:
        if not self.client.collection_exists(collection):
            raise NotFound(
                f"collection {collection!r} does not exist",
                resource_type="collection",
                resource_name=collection,
            )
        config = self.client.get_collection(collection).config.params
        dense = config.vectors[DENSE]
        return CollectionInfo(
            vector_size=dense.size,
            distance=dense.distance.value.lower(),
            sparse=SPARSE in (config.sparse_vectors or {}),
            on_disk=bool(dense.on_disk),
        )

    def create(
        self, collection: str, size: int, distance: str, sparse: bool, on_disk: bool
    ) -> bool:
        """True when created; False when it already exists with exactly these settings."""
        if self.client.collection_exists(collection):
            have = self.info(collection)
            if have != CollectionInfo(size, distance, sparse, on_disk):
                raise AlreadyExists(
                    f"collection {collection!r} exists with vector_size={have.vector_size}, "
                    f"distance={have.distance}, sparse={have.sparse}, on_disk={have.on_disk}"
                )
            return False
        self.client.create_collection(
            collection,
            vectors_config={
                DENSE: models.VectorParams(
                    size=size, distance=models.Distance[distance.upper()], on_disk=on_disk or None
                )
            },
            sparse_vectors_config=(
                {SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)}
                if sparse
                else None
            ),
        )
        return True

    def hashes(self, collection: str, doc_ids: list[str]) -> dict[str, str]:
        """The stored content hash of each of `doc_ids` that exists."""
        points = self.client.retrieve(
            collection, ids=[point_id(d) for d in doc_ids], with_payload=[ID_KEY, HASH_KEY]
        )
        return {p.payload[ID_KEY]: p.payload[HASH_KEY] for p in points if p.payload}

    def upsert(
        self,
        collection: str,
        documents: list[Incoming],
        dense: list[list[float]],
        sparse: list[tuple[list[int], list[float]]] | None,
    ) -> None:
        """Writes one batch, waiting until it is applied, so an acknowledged batch stays;
        `sparse`, the documents' BM25 vectors, when the collection has that index."""
        points = []
        for i, doc in enumerate(documents):
            vector: dict[str, Any] = {DENSE: dense[i]}
            if sparse is not None:
                vector[SPARSE] = models.SparseVector(indices=sparse[i][0], values=sparse[i][1])
            payload = {**doc.payload, ID_KEY: doc.doc_id, TEXT_KEY: doc.text, HASH_KEY: doc.digest}
            points.append(
                models.PointStruct(id=point_id(doc.doc_id), vector=vector, payload=payload)
            )
        self.client.upsert(collection, points=points, wait=True)
        if self.local:
            total = self.client.count(collection).count
            if total > LOCAL_MODE_POINTS_WARNING:
                log.warning(
                    "embedded Qdrant is brute force and slows past %d points; configure "
                    "[services.retrieval] url for a server",
                    LOCAL_MODE_POINTS_WARNING,
                    extra={"collection": collection, "points": total},
                )

    def search(
        self,
        collection: str,
        query: list[float] | models.SparseVector,
        limit: int,
        query_filter: models.Filter | None,
    ) -> list[Found]:
        """The best `limit` documents by the dense vector, or by BM25 for a sparse query."""
        result = self.client.query_points(
            collection,
            query=query,
            using=SPARSE if isinstance(query, models.SparseVector) else DENSE,
            limit=limit,
            query_filter=query_filter,
            with_payload=True,
        )
        return [
            Found(
                doc_id=p.payload[ID_KEY],
                score=p.score,
                text=p.payload[TEXT_KEY],
                payload={k: v for k, v in p.payload.items() if not k.startswith(RESERVED_PREFIX)},
            )
            for p in result.points
        ]

    def delete_ids(self, collection: str, doc_ids: list[str]) -> int:
        existing = self.hashes(collection, doc_ids)
        if existing:
            self.client.delete(
                collection,
                points_selector=models.PointIdsList(points=[point_id(d) for d in existing]),
                wait=True,
            )
        return len(existing)

    def delete_matching(
        self, collection: str, query_filter: models.Filter, guard: BulkGuard | None = None
    ) -> int:
        """Deletes what the filter matches; with a `guard`, refuses (Conflict) a filter
        that matches more of the collection than it allows."""
        count = self.client.count(collection, count_filter=query_filter, exact=True).count
        if guard is not None and count > guard.min_documents:
            total = self.client.count(collection, exact=True).count
            if count > guard.share * total:
                raise Conflict(
                    f"the filter matches {count} of the {total} documents of {collection!r}, "
                    f"more than {guard.share:.0%}; set allow_bulk to delete them all",
                    reason="BULK_DELETE",
                )
        if count:
            self.client.delete(
                collection, points_selector=models.FilterSelector(filter=query_filter), wait=True
            )
        return count


@dataclass(frozen=True)
class BulkGuard:
    """How much of a collection one Delete by filter may remove without allow_bulk."""

    share: float
    min_documents: int


def open_store(settings: RetrievalSettings, cache_dir: Path) -> Store:
    """Opens without contacting a server: a Qdrant server that is down only delays readiness."""
    if settings.url:
        client = QdrantClient(
            url=settings.url, api_key=settings.qdrant_key(), timeout=math.ceil(settings.timeout_s)
        )
        return Store(client, local=False)
    path = settings.path or cache_dir / "qdrant"
    path.mkdir(parents=True, exist_ok=True)
    return Store(QdrantClient(path=str(path)), local=True)
