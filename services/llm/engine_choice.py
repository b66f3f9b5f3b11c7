"""Which engine runs each phase of the LLM, and which GGUF the llama.cpp engine reads:
decided from the settings alone, cheaply (`aimesh up` checks a model with it before any
service starts, without importing torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from services.llm.artifacts import gguf_path
from services.llm.settings import LlmSettings


def gguf_of(settings: LlmSettings) -> Path | None:
    """The GGUF the llama.cpp engine serves: the configured one, or the embedded model's."""
    if settings.gguf is not None:
        return settings.gguf
    return gguf_path() if settings.model is None else None


def engine_of(
    settings: LlmSettings, phase: Literal["prefill", "decode"]
) -> Literal["torch", "llama.cpp"]:
    """A GGUF alone, auto: llama.cpp in both phases (the only engine that reads one).
    Otherwise decode, auto: llama.cpp on the CPU where the model has a GGUF (a step reads
    every weight: 4-bit weights read fastest); torch on a GPU (bfloat16) or for a model
    directory without one. Prefill, auto: torch (a prompt is compute-bound: torch's GEMMs
    ran 256 tokens 3.7x faster than llama.cpp here, docs/benchmarks.md)."""
    chosen = settings.prefill_engine if phase == "prefill" else settings.engine
    if chosen != "auto":
        return chosen
    if settings.gguf_only:
        return "llama.cpp"
    if phase == "prefill":
        return "torch"
    if gguf_of(settings) is None:
        return "torch"
    from services.llm.llama import resolve_device  # imported here: it imports torch

    return "torch" if resolve_device(settings.device).type == "cuda" else "llama.cpp"
