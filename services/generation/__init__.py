"""generation: the router that turns text into a disaggregated prefill/decode run, and
that run's ids back into text."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="generation",
    default_port=50060,
    description="Generate and Chat: tokenize -> prefill -> decode -> text, streamed",
    setup="services.generation.servicer:setup",
    preflight="services.llm.preflight:problems",
    options="services.generation.settings:RouterOptions",
    # A slot per generation in flight: each is a long stream that mostly waits on decode.
    max_concurrency=64,
    # An operator must reach the registry while every slot is busy: it is how a bad
    # version is rolled back.
    exempt_methods=tuple(
        f"/aimesh.llm.v1.ModelService/{method}"
        for method in ("ListModels", "GetModel", "Activate", "SetCanary", "Rollback")
    ),
    edge_services=("aimesh.llm.v1.GenerationService", "aimesh.llm.v1.ModelService"),
    dependencies=("tokenizer", "prefill", "decode"),
    callers=(
        ("aimesh.llm.v1.GenerationService", (EDGE, OPERATOR, "agent", "gateway")),
        ("aimesh.llm.v1.ModelService", (EDGE, OPERATOR)),
    ),
    scopes=(
        ("aimesh.llm.v1.GenerationService", "generate"),
        ("aimesh.llm.v1.ModelService", "admin"),
        ("/aimesh.llm.v1.ModelService/ListModels", "read"),
        ("/aimesh.llm.v1.ModelService/GetModel", "read"),
    ),
)
