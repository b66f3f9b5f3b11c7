"""generation: the router that turns text into a disaggregated prefill/decode run, and
that run's ids back into text."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="generation",
    default_port=50060,
    description="Generate and Chat: tokenize -> prefill -> decode -> text, streamed",
    setup="services.generation.servicer:setup",
    options="services.generation.settings:RouterOptions",
    # A slot per generation in flight: each is a long stream that mostly waits on decode.
    max_concurrency=64,
    edge_services=("aimesh.llm.v1.GenerationService",),
    dependencies=("tokenizer", "prefill", "decode"),
    callers=(("aimesh.llm.v1.GenerationService", (EDGE, OPERATOR, "agent", "gateway")),),
    scopes=(("aimesh.llm.v1.GenerationService", "generate"),),
)
