"""rerank: reorders retrieved passages by a model-based relevance score."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="rerank",
    default_port=50072,
    description="Rerank: candidates scored against the query, best first",
    setup="services.rerank.servicer:setup",
    options="services.rerank.settings:RerankSettings",
    edge_services=("aimesh.rerank.v1.RerankService",),
    callers=(("aimesh.rerank.v1.RerankService", (EDGE, OPERATOR, "gateway", "retrieval")),),
    scopes=(("aimesh.rerank.v1.RerankService", "embed"),),
)
