"""The request id: one id per user request, carried in `x-request-id` across every hop.

A caller may supply it; otherwise the first server generates one. Logs and spans carry
it, so one grep finds a request everywhere, even where tracing is off.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from typing import Any

import grpc

METADATA_KEY = "x-request-id"
_MAX_LENGTH = 128

_request_id: ContextVar[str] = ContextVar("aimesh_request_id", default="")


def current() -> str:
    return _request_id.get()


def ensure(request_id: str = "") -> str:
    """Returns the id of the current request, adopting `request_id` (or a new one) if none."""
    existing = _request_id.get()
    if existing:
        return existing
    chosen = request_id[:_MAX_LENGTH] or os.urandom(16).hex()
    _request_id.set(chosen)
    return chosen


def adopt(context: grpc.aio.ServicerContext) -> None:
    """Takes the caller's id from metadata, or starts a new one, for this call's task."""
    incoming = ""
    for key, value in context.invocation_metadata() or ():
        if key == METADATA_KEY and isinstance(value, str):
            incoming = value[:_MAX_LENGTH]
            break
    _request_id.set(incoming or os.urandom(16).hex())


def with_request_id(metadata: Any) -> grpc.aio.Metadata | Any:
    """Outgoing metadata carrying the current request id, unless the caller set one."""
    request_id = _request_id.get()
    if not request_id:
        return metadata
    outgoing = grpc.aio.Metadata(*(metadata or ()))
    if METADATA_KEY not in outgoing:
        outgoing.add(METADATA_KEY, request_id)
    return outgoing
