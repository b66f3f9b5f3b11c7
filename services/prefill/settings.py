"""Prefill's own settings ([services.prefill] in the mesh config); the model's are the
shared [engines.llm]."""

from __future__ import annotations

from mesh.config import ServiceOptions


class PrefillOptions(ServiceOptions):
    # The address decode workers pull this worker's KV from, written into every KV handle:
    # a pod's own IP in Kubernetes; None: this server's host and port.
    advertise_address: str | None = None
