"""The embedder's settings ([services.embedder] in the mesh config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mesh.config import ServiceOptions
from mesh.triton import TritonSettings


class EmbedderSettings(ServiceOptions):
    # loadtest/embed.py, 2 cores, 1 thread: ONNX Runtime 182 texts/s, torch 104.
    backend: Literal["onnx", "torch", "triton"] = "onnx"
    # backend = "triton": the pooled model runs on Triton Inference Server (the model
    # k8s/triton-model-repository/sentence_embedding serves); tokenizing stays here.
    triton: TritonSettings | None = None
    max_batch_texts: int = Field(
        default=64, ge=1, description="a micro-batch stops gathering requests at this many texts"
    )
    max_wait_ms: float = Field(
        default=2.0, ge=0, description="how long a micro-batch waits for more requests"
    )
    # TEI's name. Rows run longest first, so a small budget groups similar lengths and
    # pads little. On 2 cores at 1 thread (onnx), 256 embedded mixed docstrings at 182
    # texts/s against 42 with one padded pass per 32 texts (loadtest/embed.py), and short
    # sentences still share passes (25 of 10 tokens: 747/s, against 341/s one by one).
    # A GPU wants far more.
    max_batch_tokens: int = Field(
        default=256, ge=256, description="padded tokens in one forward pass (at least one row)"
    )
    # Several model processes share the cores of a small machine; one intra-op thread each
    # keeps them from fighting. Raise it for an embedder with cores of its own.
    threads: int = Field(default=1, ge=1, description="torch / ONNX Runtime intra-op threads")

    @model_validator(mode="after")
    def _triton_named(self) -> EmbedderSettings:
        if self.backend == "triton" and self.triton is None:
            raise ValueError("backend 'triton' needs a [services.embedder.triton] section")
        return self
