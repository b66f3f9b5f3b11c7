"""The router's own settings ([services.generation] in the mesh config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mesh.config import ServiceOptions
from mesh.triton import TritonSettings
from services.generation.canary_rule import CanaryRuleSettings


class RouterOptions(ServiceOptions):
    """[services.generation]. Tokenizer, prefill and decode are declared dependencies:
    [services.generation.dependencies] overrides where each is dialled. The lists name
    several workers of one kind (empty: the dependency's one target)."""

    # "triton": the model runs on Triton Inference Server as a decoupled model (the one
    # k8s/triton-model-repository/text_generation serves); tokenizing stays in the mesh.
    backend: Literal["disaggregated", "triton"] = "disaggregated"
    triton: TritonSettings | None = None
    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    poll_interval_s: float = Field(default=0.25, gt=0)
    # How often the registry (the mesh config's `deployments`) is read for changes, and
    # the canary rule judges.
    registry_poll_s: float = Field(default=1.0, gt=0)
    # A version whose workers are not ready in this long is not routed to (yet).
    warm_timeout_s: float = Field(default=120.0, gt=0)
    canary_rule: CanaryRuleSettings = Field(default_factory=CanaryRuleSettings)

    @model_validator(mode="after")
    def _triton_named(self) -> RouterOptions:
        if (self.backend == "triton") != (self.triton is not None):
            raise ValueError(
                "backend 'triton' and a [services.generation.triton] section go together"
            )
        return self
