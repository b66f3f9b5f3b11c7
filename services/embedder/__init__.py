"""embedder: sentence embeddings (all-MiniLM-L6-v2) on torch or ONNX Runtime, batched."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="embedder",
    default_port=50070,
    description="Embed: dense sentence embeddings, requests arriving together batched",
    setup="services.embedder.servicer:setup",
    options="services.embedder.settings:EmbedderSettings",
    # Requests arriving together share a forward pass; slots let them arrive together.
    max_concurrency=32,
    edge_services=("aimesh.retrieval.v1.EmbedderService",),
    callers=(("aimesh.retrieval.v1.EmbedderService", (EDGE, OPERATOR, "gateway", "retrieval")),),
    scopes=(("aimesh.retrieval.v1.EmbedderService", "embed"),),
)
