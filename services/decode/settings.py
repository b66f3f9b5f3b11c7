"""Decode's own settings ([services.decode] in the mesh config); the model's are the
shared [engines.llm]."""

from __future__ import annotations

from pydantic import Field

from mesh.config import ServiceOptions


class DecodeOptions(ServiceOptions):
    # The prefill workers' targets (host:port, dns:///name:port, ipv4:a:p,b:p); empty:
    # the prefill dependency's target. KV handles naming any other address are refused.
    prefill: list[str] = Field(default_factory=list)
