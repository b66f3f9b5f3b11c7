"""Prefill's own settings ([services.prefill] in the mesh config); the model's are the
shared [engines.llm]."""

from __future__ import annotations

from pydantic import Field

from mesh.config import ServiceOptions


class PrefillOptions(ServiceOptions):
    # The address decode workers pull this worker's KV from, written into every KV handle:
    # a pod's own IP in Kubernetes; None: this server's host and port.
    advertise_address: str | None = None
    # The KV of recent prompts, reused by prompts that start the same way
    # (services/prefill/prefix_cache.py); 0 turns the cache off.
    prefix_cache_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
