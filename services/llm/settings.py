"""Settings shared by every LLM service ([engines.llm] in the mesh config).

Tokenizer, prefill and decode must agree on the model and its limits, so they read one
section instead of three copies in their own service options.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from mesh.config import MeshSettings


class LlmSettings(BaseModel, extra="forbid"):
    model: Path | None = Field(
        default=None,
        description="A local Hugging Face model directory (Llama family), or a GGUF file "
        "(the same as gguf = that file); None: the embedded SmolLM2-135M-Instruct, "
        "converted once from its GGUF into cache_dir",
    )
    engine: Literal["auto", "torch", "llama.cpp"] = Field(
        default="auto",
        description="decode's engine. auto: llama.cpp (the GGUF's 4-bit weights on its CPU "
        "kernels) on the CPU when the model has a GGUF, which the embedded one has; torch "
        "(the exact reference, and bfloat16 on GPUs) otherwise",
    )
    prefill_engine: Literal["auto", "torch", "llama.cpp"] = Field(
        default="auto",
        description="prefill's engine. auto: torch, whose GEMMs run a prompt several times "
        "faster than llama.cpp's kernels on a CPU (docs/benchmarks.md); llama.cpp decode "
        "reads its KV written as llama.cpp's state. llama.cpp prefill hands decode "
        "llama.cpp's own state, which only llama.cpp decode reads",
    )
    gguf: Path | None = Field(
        default=None,
        description="a GGUF file: alone, the whole model (weights, vocabulary, special "
        "tokens, chat template and limits from its metadata, on the llama.cpp engine); "
        "with `model`, the same weights for the llama.cpp engine (its vocabulary must "
        "match); None: the embedded model's, when `model` is None",
    )
    chat_template: Path | None = Field(
        default=None,
        description="a Jinja chat template file used instead of the model's own (a GGUF "
        "without one serves chat with it); None: the model's template, and a model "
        "without one refuses chat with INVALID_ARGUMENT",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="auto: bfloat16 where the device multiplies it in hardware (a CUDA GPU "
        "with bfloat16, a CPU with AVX-512 BF16 or AMX), else float32; resolved in each "
        "process, and decode takes KV in either",
    )
    # Weights, activations and the KV cache live on this device; logits come back to the
    # CPU for sampling (one [batch, vocab] copy a step, which reading the token needs anyway).
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: CUDA when torch sees a GPU, else the CPU"
    )
    max_seq_len: int = Field(default=2048, ge=16, description="prompt + completion, tokens")
    max_batch_size: int = Field(default=16, ge=1, description="decode slots")
    default_max_new_tokens: int = Field(default=256, ge=1)
    max_new_tokens_limit: int = Field(default=2048, ge=1)
    kv_store_bytes: int = Field(
        default=512 * 1024 * 1024, ge=1024 * 1024, description="prefill's leased KV budget"
    )
    memory_budget_bytes: int = Field(
        default=0,
        ge=0,
        description="what a llama.cpp prefill or decode process may take (weights + KV + "
        "compute buffers, estimated before loading); 0: the memory available at its start",
    )
    # Decode steps llama.cpp's kernels on every thread it is given, and a step waits for
    # the slowest: on two cores shared with prefill and the router, two decode threads
    # still stream 1.3-1.6x the tokens of one at 16 streams (docs/benchmarks.md). Prefill's
    # idle threads sleep instead of spinning (its ServiceSpec's OMP_WAIT_POLICY), so its
    # cores are decode's between prompts.
    threads: int = Field(
        default=0,
        ge=0,
        description="threads per prefill or decode process (torch intra-op, llama.cpp); "
        "0: every core the process may run on",
    )

    @model_validator(mode="after")
    def _gguf_given_as_model(self) -> LlmSettings:
        """`model = "x.gguf"` (and `aimesh up --model x.gguf`) names a complete model."""
        if self.model is not None and self.model.suffix.lower() == ".gguf":
            if self.gguf is not None and self.gguf != self.model:
                raise ValueError("model names one GGUF and gguf another: give one")
            self.gguf, self.model = self.model, None
        return self

    @property
    def gguf_only(self) -> bool:
        """A model given as a GGUF alone: tokenizer, template and limits come from it."""
        return self.model is None and self.gguf is not None

    def thread_count(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


def llm_settings(settings: MeshSettings) -> LlmSettings:
    """[engines.llm]; for a GGUF alone, max_seq_len no longer than the model's context."""
    llm = LlmSettings.model_validate(settings.engines.get("llm", {}))
    if llm.gguf is None or not llm.gguf_only:
        return llm
    from services.llm.gguf import read_facts  # imported here: it loads llama.cpp

    context = read_facts(llm.gguf).context_length
    if 0 < context < llm.max_seq_len:
        return llm.model_copy(update={"max_seq_len": context})
    return llm
