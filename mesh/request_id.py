"""The request id: one id per user request, carried in `x-request-id` across every hop.

A caller may supply it; otherwise the first server generates one. Logs and spans carry
it, so one grep finds a request everywhere, even where tracing is off.
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from typing import Any

import grpc

from mesh.rpc import BehaviorInterceptor, ClientInterceptor, StreamBehavior, UnaryBehavior

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
    chosen = request_id[:_MAX_LENGTH] or uuid.uuid4().hex
    _request_id.set(chosen)
    return chosen


def _adopt(context: grpc.aio.ServicerContext) -> None:
    incoming = ""
    for key, value in context.invocation_metadata() or ():
        if key == METADATA_KEY and isinstance(value, str):
            incoming = value[:_MAX_LENGTH]
            break
    _request_id.set(incoming or uuid.uuid4().hex)


class RequestIdServerInterceptor(BehaviorInterceptor):
    def wrap_unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _adopt(context)
            return await behavior(request, context)

        return handle

    def wrap_stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _adopt(context)
            async for response in behavior(request, context):
                yield response

        return handle


class RequestIdClientInterceptor(ClientInterceptor):
    """Adds the current request id to outgoing metadata unless the caller set one."""

    @staticmethod
    def _with_id(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        request_id = _request_id.get()
        if not request_id:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if METADATA_KEY in metadata:
            return details
        metadata.add(METADATA_KEY, request_id)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_id(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_id(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_id(details), requests)

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_id(details), requests)
