"""tokenizer: the model's tokenizer and chat template as a service."""

from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="tokenizer",
    default_port=50061,
    description="Tokenize, Detokenize, DetokenizeStream and ApplyChatTemplate for the LLM",
    setup="services.tokenizer.servicer:setup",
    preflight="services.llm.preflight:problems",
    # A generation's detokenize stream stays open as long as the generation; it is cheap
    # per message and must not hold one of the compute slots Tokenize calls queue for.
    exempt_methods=("/aimesh.tokenizer.v1.TokenizerService/DetokenizeStream",),
    callers=(("aimesh.tokenizer.v1.TokenizerService", ("generation",)),),
)
