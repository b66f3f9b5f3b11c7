"""The tools service's settings ([services.tools] in the mesh config)."""

from __future__ import annotations

from pydantic import Field

from mesh.config import ServiceOptions


class ToolsSettings(ServiceOptions):
    knowledge_collection: str = "knowledge"
    # How long a repeated idempotency key returns the first call's result.
    idempotency_window_s: float = Field(default=600, gt=0)
    # How many keys (all clients together) are remembered, results included (a few KB each,
    # images more); past it the oldest is forgotten.
    idempotency_max_keys: int = Field(default=4096, gt=0)
    # Per-tool overrides of the built-in limits, e.g. {"generate_image": 300}.
    timeout_s: dict[str, float] = Field(default_factory=dict)
    idle_timeout_s: dict[str, float] = Field(default_factory=dict)
    # The absolute cap on any call, whatever a tool's own limit or override says.
    max_call_s: float = Field(default=300, gt=0)
