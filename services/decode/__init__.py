"""decode: continuous batching over a slot KV cache, fed by KV pulled from prefill."""

from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="decode",
    default_port=50063,
    description="Decode + GetLoad: the token-by-token half of disaggregated serving",
    setup="services.decode.servicer:setup",
    preflight="services.llm.preflight:problems",
    options="services.decode.settings:DecodeOptions",
    dependencies=("prefill",),
    # One slot per stream in the running batch (max_batch_size defaults to 16).
    max_concurrency=16,
    # The router polls load to pick a worker; that must answer while every slot is busy.
    exempt_methods=("/aimesh.llm.v1.DecodeService/GetLoad",),
    callers=(("aimesh.llm.v1.DecodeService", ("generation",)),),
)
