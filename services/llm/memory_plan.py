"""Memory before load: what a llama.cpp process of a GGUF will need, checked against the
budget before any weight is read, so that a model too large for the machine is refused
with the numbers instead of dying half-loaded (or taking the machine with it).

The estimate is llama.cpp's own arithmetic for its three parts: the weights (the GGUF's
tensors, about its file size), the KV cache (every sequence slot's tokens times the model's
KV bytes per token) and the compute buffers (one batch of activations and the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.failures import NotReady
from services.llm.gguf import GgufFacts
from services.llm.settings import LlmSettings

GIB = 1024**3
# Prompt tokens per llama_decode (services/llm/llama_cpp.py PREFILL_CHUNK): the batch the
# compute buffers are sized for.
BATCH_TOKENS = 512
# Activations of one batch token: a few hidden-size float32 vectors live at once (the
# residual, norms, attention and MLP inputs); llama.cpp's graph allocator reuses the rest.
ACTIVATION_VECTORS = 8
FLOAT_BYTES = 4


@dataclass(frozen=True)
class MemoryNeed:
    weights: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def __str__(self) -> str:
        return (
            f"{self.total / GIB:.2f} GiB (weights {self.weights / GIB:.2f}, KV "
            f"{self.kv / GIB:.2f}, compute {self.compute / GIB:.2f})"
        )


def need(facts: GgufFacts, sequences: int, max_seq_len: int) -> MemoryNeed:
    """What one llama.cpp context of `sequences` slots of `max_seq_len` tokens needs."""
    batch = max(BATCH_TOKENS, sequences)
    activations = batch * facts.embedding_length * ACTIVATION_VECTORS * FLOAT_BYTES
    logits = max(sequences, 1) * facts.vocab_size * FLOAT_BYTES
    return MemoryNeed(
        weights=facts.file_bytes,
        kv=sequences * max_seq_len * facts.kv_bytes_per_token,
        compute=activations + logits,
    )


def available_bytes() -> int:
    """Memory the kernel says a new process can take without swapping (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def budget(settings: LlmSettings) -> int:
    return settings.memory_budget_bytes or available_bytes()


def check_fits(facts: GgufFacts, settings: LlmSettings, sequences: int) -> MemoryNeed:
    """The need of one process, or NotReady saying what to change when it does not fit."""
    wanted = need(facts, sequences, settings.max_seq_len)
    limit = budget(settings)
    if wanted.total > limit:
        raise NotReady(
            f"{facts.path.name} with {sequences} sequence(s) of {settings.max_seq_len} tokens "
            f"needs about {wanted}, more than the {limit / GIB:.2f} GiB budget "
            f"({'memory_budget_bytes' if settings.memory_budget_bytes else 'memory available'}"
            "): lower [engines.llm] max_seq_len or max_batch_size, or use a smaller "
            "quantization of the model"
        )
    return wanted
