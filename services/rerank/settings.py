"""The rerank service's settings ([services.rerank] in the mesh config), checked when they
load: a scorer that cannot run as configured is refused at startup, not at the first call."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from mesh.config import ServiceOptions
from mesh.triton import TritonSettings


class RerankSettings(ServiceOptions):
    """The embedded late-interaction scorer (in process or on Triton), or a local
    cross-encoder."""

    # "triton": the transformer behind minilm-late-interaction runs on Triton Inference
    # Server (k8s/triton-model-repository/token_embedding); tokenizing and the MaxSim and
    # cosine arithmetic stay here, shared with the in-process scorer.
    backend: Literal["torch", "triton"] = "torch"
    triton: TritonSettings | None = None
    cross_encoder: Path | None = None
    alpha: float = Field(default=0.3, ge=0, le=1)
    document_tokens: int = Field(default=128, ge=8, le=512)
    pass_tokens: int = Field(default=2048, ge=256)
    threads: int = Field(default=1, ge=1, description="torch intra-op threads, in process")

    @model_validator(mode="after")
    def _triton_named(self) -> RerankSettings:
        if self.backend == "triton" and self.triton is None:
            raise ValueError("backend 'triton' needs a [services.rerank.triton] section")
        if self.backend != "triton" and self.triton is not None:
            raise ValueError("[services.rerank.triton] is read only with backend = 'triton'")
        if self.backend == "triton" and self.cross_encoder is not None:
            raise ValueError(
                "cross_encoder runs in process; backend 'triton' serves minilm-late-interaction"
            )
        return self
