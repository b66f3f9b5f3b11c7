"""OpenTelemetry tracing for servers and channels, configured by the standard OTEL_* vars.

OTEL_TRACES_EXPORTER: `otlp` (to OTEL_EXPORTER_OTLP_ENDPOINT), `console`, or `none`
(the default here, so a laptop without a collector does not log export errors);
OTEL_SERVICE_NAME names the process; OTEL_SDK_DISABLED=true removes the tracing
interceptors altogether (docs/benchmarks.md shows what they cost). Interceptors come from
opentelemetry-instrumentation-grpc, with its aio client bugs worked around below.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.instrumentation.grpc._aio_client import (
    StreamStreamAioClientInterceptor,
    StreamUnaryAioClientInterceptor,
    UnaryStreamAioClientInterceptor,
    UnaryUnaryAioClientInterceptor,
)
from opentelemetry.instrumentation.grpc.version import __version__ as instrumentation_version
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Status, StatusCode

from mesh.rpc import is_infrastructure


def _traced(details: grpc.HandlerCallDetails) -> bool:
    """Health and reflection are probes, not traffic; and the health Watch handler is
    written in read/write style, which the aio server interceptor breaks (contrib #3066).
    One set lookup, where upstream's composed filters cost ~5% of a small call."""
    return not is_infrastructure(details.method)


def configure(default_service_name: str, *, processor: SpanProcessor | None = None) -> None:
    """Installs the process's TracerProvider once; later calls only add `processor`."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        name = os.environ.get("OTEL_SERVICE_NAME", default_service_name)
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        exporter = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
        if exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif exporter == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(provider)
    if processor is not None:
        provider.add_span_processor(processor)


def otlp_endpoint() -> str | None:
    """Where OTLP/gRPC spans go, by the same OTEL_* rules the SDK follows; None: nowhere.
    Envoy's tracer needs it spelled out, since it does not read the environment."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower() != "otlp":
        return None
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or "http://localhost:4317"
    )


def enabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor(filter_=_traced)] if enabled() else []


class _CancelSafeUnaryResponse:
    """Fixes contrib #3271 for unary-response calls.

    Upstream awaits the call's status without handling cancellation: when the caller's task
    is cancelled, the RPC keeps running and the span is never ended. Here the call is
    cancelled and the span closed with status CANCELLED.
    """

    async def _wrap_unary_response(self, continuation: Any, span: Any) -> Any:
        started: list[Any] = []

        async def start() -> Any:
            started.append(await continuation())
            return started[0]

        try:
            return await super()._wrap_unary_response(start, span)  # type: ignore[misc]
        except asyncio.CancelledError:
            if started:
                started[0].cancel()
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
            span.set_status(Status(StatusCode.ERROR, "cancelled by the caller"))
            span.end()
            raise


class _UnaryUnary(_CancelSafeUnaryResponse, UnaryUnaryAioClientInterceptor):
    pass


class _StreamUnary(_CancelSafeUnaryResponse, StreamUnaryAioClientInterceptor):
    pass


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """One tracing interceptor per arity, outermost in every mesh channel.

    Streaming calls come back from upstream as async generators (contrib #2014); grpc.aio
    wraps them so that `cancel()`, `code()` and metadata still reach the real call, which
    tests/mesh/test_tracing.py checks with instrumentation on.
    """
    if not enabled():
        return []
    tracer = trace.get_tracer(
        "opentelemetry.instrumentation.grpc",
        instrumentation_version,
        schema_url="https://opentelemetry.io/schemas/1.11.0",
    )
    return [
        _UnaryUnary(tracer),
        UnaryStreamAioClientInterceptor(tracer),
        _StreamUnary(tracer),
        StreamStreamAioClientInterceptor(tracer),
    ]


def current_trace_id() -> str:
    """Hex trace id of the active span, or '' when there is none."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
