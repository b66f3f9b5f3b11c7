"""Retrieval settings ([services.retrieval] in the mesh config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from mesh.config import ServiceOptions


class RetrievalSettings(ServiceOptions):
    def qdrant_key(self) -> str | None:
        return None if self.api_key is None else self.api_key.get_secret_value()

    url: str | None = Field(
        default=None,
        description="A Qdrant server or cluster (http[s]://host:6333); None: embedded on disk",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="Qdrant API key (never logged); in Kubernetes from Secret aimesh-qdrant",
    )
    path: Path | None = Field(default=None, description="embedded store; None: <cache_dir>/qdrant")
    timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="per Qdrant call when the caller brings no deadline, and its cap",
    )
    rrf_k: int = Field(default=60, ge=1, description="reciprocal rank fusion constant")
    # Each retriever of a hybrid search looks this many times deeper than top_k, so fusion
    # can promote a document that one retriever ranks low.
    prefetch_factor: int = Field(default=4, ge=1)
    embed_batch: int = Field(default=32, ge=1, le=32)
    bulk_delete_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="a Delete by filter matching more of a collection than this needs allow_bulk",
    )
    bulk_delete_min: int = Field(
        default=100, ge=0, description="deletes of up to this many documents are never held"
    )
