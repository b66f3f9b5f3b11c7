"""prefill: runs prompts, samples their first token, and leases their KV to decoders."""

from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="prefill",
    default_port=50062,
    description="Prefill + KvCache.Pull/Release: the prompt half of disaggregated serving",
    setup="services.prefill.servicer:setup",
    preflight="services.llm.preflight:problems",
    options="services.prefill.settings:PrefillOptions",
    # Pulls and releases move memory out of the worker; they must never queue behind
    # prompt computation, or a busy prefill worker would stall every decoder.
    exempt_methods=(
        "/aimesh.llm.v1.KvCacheService/Pull",
        "/aimesh.llm.v1.KvCacheService/Release",
    ),
    # Torch's OpenMP threads sleep between prompts instead of spinning on the cores that
    # decode steps on: at 16 streams a spinning prefill took half a core and decode's
    # tokens/s fell by a quarter (docs/benchmarks.md).
    environment=(("OMP_WAIT_POLICY", "PASSIVE"),),
    # Only the router asks for prompts; only decode takes KV away, and the router frees
    # the KV of a generation that ended before decode took it.
    callers=(
        ("aimesh.llm.v1.PrefillService", ("generation",)),
        ("/aimesh.llm.v1.KvCacheService/Pull", ("decode",)),
        ("/aimesh.llm.v1.KvCacheService/Release", ("decode", "generation")),
    ),
)
