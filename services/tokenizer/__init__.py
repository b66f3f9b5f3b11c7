"""tokenizer: the model's tokenizer and chat template as a service."""

from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="tokenizer",
    default_port=50061,
    description="Tokenize, Detokenize, DetokenizeStream and ApplyChatTemplate for the LLM",
    setup="services.tokenizer.servicer:setup",
)
