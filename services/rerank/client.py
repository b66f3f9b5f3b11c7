"""Reranking retrieved hits through the rerank service, as its callers all do it."""

from __future__ import annotations

from typing import Any

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc


async def rerank_hits(
    stub: rerank_pb2_grpc.RerankServiceStub,
    query: str,
    hits: list[dict[str, Any]],
    top_n: int,
) -> tuple[list[dict[str, Any]], rerank_pb2.RerankResponse]:
    """`hits` ({"id", "text", ...}) best first by the reranker's score, at most top_n.

    Candidates are cut at the scorer's token limit rather than refused: ingested passages
    may run past it, and ranking on their first 512 tokens beats failing the search.
    """
    ranked = await stub.Rerank(
        rerank_pb2.RerankRequest(
            query=query,
            documents=[rerank_pb2.Document(id=h["id"], text=h["text"]) for h in hits],
            top_n=top_n,
            truncate=True,
        )
    )
    return [{**hits[r.index], "score": r.score} for r in ranked.results], ranked
