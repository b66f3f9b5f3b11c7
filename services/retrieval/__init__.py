"""retrieval: collections of passages in Qdrant, searched dense, sparse or hybrid, and
reranked by the rerank service when a search asks."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="retrieval",
    default_port=50071,
    description="CreateCollection, Upsert, Search (dense + BM25 fused by RRF), Delete",
    setup="services.retrieval.servicer:setup",
    options="services.retrieval.settings:RetrievalSettings",
    # Calls mostly wait on the embedder and the store's own thread.
    max_concurrency=16,
    edge_services=("aimesh.retrieval.v1.RetrievalService",),
    dependencies=("embedder", "rerank"),
    # Tools only search; writes come from outside (the edge checks the key's write scope).
    callers=(
        ("aimesh.retrieval.v1.RetrievalService", (EDGE, OPERATOR)),
        ("/aimesh.retrieval.v1.RetrievalService/Search", (EDGE, OPERATOR, "tools")),
    ),
    # Writes change what every tenant's searches find: a scope of their own.
    scopes=(
        ("aimesh.retrieval.v1.RetrievalService", "write"),
        ("/aimesh.retrieval.v1.RetrievalService/Search", "read"),
    ),
)
