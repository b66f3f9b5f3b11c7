"""Reciprocal rank fusion of the dense and sparse retrievers, keeping each one's verdict.

Qdrant's Query API fuses prefetches with RRF too; fusing here instead lets every hit
report where each retriever ranked it (HitSource), which is what makes a hybrid result
explainable. score = sum over retrievers of 1 / (k + rank), rank 1-based.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.retrieval.store import Found


@dataclass
class Hit:
    doc_id: str
    score: float  # the fused score, until the engine says otherwise
    text: str
    payload: dict[str, Any] | None
    # retriever name ("dense", "sparse") -> (1-based rank, that retriever's score)
    sources: dict[str, tuple[int, float]] = field(default_factory=dict)


def reciprocal_rank_fusion(ranked: dict[str, list[Found]], k: int) -> list[Hit]:
    fused: dict[str, Hit] = {}
    for retriever, found in ranked.items():
        for rank, hit in enumerate(found, start=1):
            entry = fused.setdefault(hit.doc_id, Hit(hit.doc_id, 0.0, hit.text, hit.payload))
            entry.score += 1.0 / (k + rank)
            entry.sources[retriever] = (rank, hit.score)
    return sorted(fused.values(), key=lambda hit: (-hit.score, hit.doc_id))
