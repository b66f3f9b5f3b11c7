"""One trace across every hop, a span per hop, unary and streaming."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from tests.conftest import echo_stub, eventually, target

pytestmark = pytest.mark.service


def _spans_of(spans, trace_id: str):
    return [s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]


async def test_one_trace_across_three_hops_streaming(echo_server, spans):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        call = stub.Relay(echo_pb2.RelayRequest(hops=[target(b), target(c)], count=3), timeout=5)
        responses = [r async for r in call]
    trace_ids = {hop.trace_id for r in responses for hop in r.hops}
    assert len(trace_ids) == 1
    (trace_id,) = trace_ids
    assert len(trace_id) == 32 and trace_id != "0" * 32

    def relay_spans(kind):
        return [s for s in _spans_of(spans, trace_id) if s.kind == kind and "Relay" in s.name]

    await eventually(lambda: len(relay_spans(SpanKind.SERVER)) == 3)
    await eventually(lambda: len(relay_spans(SpanKind.CLIENT)) == 3)
    # Each server span's parent is a client span of the same trace: the hops are linked.
    client_ids = {s.context.span_id for s in relay_spans(SpanKind.CLIENT)}
    assert all(s.parent.span_id in client_ids for s in relay_spans(SpanKind.SERVER))


async def test_one_trace_across_three_hops_unary(echo_server, spans):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        response = await stub.RelayUnary(
            echo_pb2.RelayUnaryRequest(hops=[target(b), target(c)]), timeout=5
        )
    (trace_id,) = {hop.trace_id for hop in response.hops}
    finished = _spans_of(spans, trace_id)
    servers = [s for s in finished if s.kind == SpanKind.SERVER]
    clients = [s for s in finished if s.kind == SpanKind.CLIENT]
    assert len(servers) == 3 and len(clients) == 3
    assert {s.name for s in servers} == {"/aimesh.echo.v1.EchoService/RelayUnary"}


async def test_cancelled_unary_call_ends_its_client_span(echo_server, spans):
    server = await echo_server()
    stub, channel = echo_stub(server)

    async def call() -> None:
        await stub.Echo(echo_pb2.EchoRequest(delay_ms=30_000), timeout=60)

    async with channel:
        task = asyncio.create_task(call())
        await eventually(lambda: server.admission.in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    def cancelled_client_spans():
        return [
            s
            for s in spans.get_finished_spans()
            if s.kind == SpanKind.CLIENT
            and s.attributes.get("rpc.grpc.status_code") == grpc.StatusCode.CANCELLED.value[0]
        ]

    await eventually(lambda: len(cancelled_client_spans()) == 1)
    assert cancelled_client_spans()[0].status.status_code == StatusCode.ERROR


async def test_stream_call_keeps_its_call_api_under_tracing(echo_server):
    """contrib #2014: traced streams come back as generators; cancel() and code() must work."""
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=100, interval_ms=50), timeout=10)
        assert (await call.read()).index == 0
        assert call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: server.admission.in_flight == 0)


async def test_traceparent_from_an_external_caller_is_honoured(echo_server):
    """A client outside the mesh (Envoy, grpcurl) sends W3C traceparent; the trace continues."""
    server = await echo_server()
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        response = await stub.Echo(
            echo_pb2.EchoRequest(), metadata=(("traceparent", incoming),), timeout=5
        )
    assert response.trace_id == "0af7651916cd43dd8448eb211c80319c"
