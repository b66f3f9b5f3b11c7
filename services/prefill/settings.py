"""Prefill's own settings ([services.prefill] in the mesh config); the model's are the
shared [engines.llm]."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mesh.config import ServiceOptions


class PrefillOptions(ServiceOptions):
    # The address decode workers pull this worker's KV from, written into every KV handle:
    # a pod's own IP in Kubernetes; None: this server's host and port.
    advertise_address: str | None = None
    # The KV of recent prompts, reused by prompts that start the same way
    # (services/prefill/prefix_cache.py); 0 turns the cache off.
    prefix_cache_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # Who may reuse a cached prefix (services/llm/prefix.py): "tenant" (the default) scopes
    # it by the caller's client and the request's cache_salt, so no tenant can learn from
    # a hit that another sent a prompt; "mesh" drops the client (the salt still scopes),
    # for an operator whose callers all trust each other (one tenant, or a shared system
    # prompt worth more than the side channel it opens).
    prefix_cache_scope: Literal["tenant", "mesh"] = "tenant"
    # Prompts run in passes cut at fixed positions, a cached prefix used up to the last cut
    # in it (services/llm/passes.py): greedy output is then the same with or without a
    # prefix-cache hit. False: one pass from wherever the hit ends (reuses a hit to the
    # token and runs a long prompt in fewer passes; docs/benchmarks.md says how much that
    # saves), and greedy text may differ after a hit.
    fixed_passes: bool = True
