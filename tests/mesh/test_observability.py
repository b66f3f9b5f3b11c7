"""Request ids across hops, JSON logs with trace ids, message-size limits."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging

import grpc
import pytest
from opentelemetry import trace

from aimesh.echo.v1 import echo_pb2
from mesh import logs, request_id
from mesh.failures import InvalidInput
from tests.conftest import echo_stub, target

pytestmark = pytest.mark.service


async def test_callers_request_id_and_client_reach_every_hop(echo_server):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        response = await stub.RelayUnary(
            echo_pb2.RelayUnaryRequest(hops=[target(b), target(c)]),
            metadata=(("x-request-id", "req-42"), ("x-aimesh-client", "alice")),
            timeout=5,
        )
        generated = await stub.RelayUnary(echo_pb2.RelayUnaryRequest(hops=[target(b)]), timeout=5)
    assert [hop.request_id for hop in response.hops] == ["req-42"] * 3
    # The edge's client name travels on, so per-client state deep down is the caller's.
    assert [hop.client for hop in response.hops] == ["alice"] * 3
    assert [hop.client for hop in generated.hops] == ["", ""]
    # Without one, the first hop makes one up and the next hop sees the same.
    (made_up,) = {hop.request_id for hop in generated.hops}
    assert len(made_up) == 32


def test_log_lines_are_json_with_trace_span_and_request_ids():
    stream = io.StringIO()

    def log_inside_a_request() -> trace.SpanContext:
        request_id.ensure("req-7")
        with trace.get_tracer("test").start_as_current_span("work") as span:
            logging.getLogger("aimesh.test").info("inside", extra={"tokens": 3})
            return span.get_span_context()

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logs.configure("test-service", level="INFO", stream=stream)
        # A fresh context, so the request id does not leak into later tests.
        context = contextvars.copy_context().run(log_inside_a_request)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    line = json.loads(stream.getvalue().strip().splitlines()[-1])
    assert line["message"] == "inside" and line["level"] == "INFO"
    assert line["service"] == "test-service" and line["tokens"] == 3
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")
    assert line["request_id"] == "req-7"


async def test_message_size_limit_is_the_configured_one(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        # 16 MiB: four times grpc's 4 MiB default, inside the configured 32 MiB.
        big = await stub.Echo(echo_pb2.EchoRequest(response_size=16 * 1024 * 1024), timeout=30)
        assert len(big.payload) == 16 * 1024 * 1024
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Echo(echo_pb2.EchoRequest(payload=bytes(40 * 1024 * 1024)), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_request_id_from_a_body_replaces_only_a_made_up_one():
    def scenario(metadata_id: str, body_id: str) -> str:
        class Context:
            def invocation_metadata(self):
                return (("x-request-id", metadata_id),) if metadata_id else ()

        request_id.adopt(Context())
        return request_id.ensure(body_id)

    run = contextvars.copy_context().run
    assert run(scenario, "", "from-body") == "from-body"
    assert run(scenario, "from-metadata", "from-body") == "from-metadata"
    assert len(run(scenario, "", "")) == 32


@pytest.mark.parametrize("body_id", ["é-request", "two words", "x" * 129, "tab\there", "\x00"])
def test_a_body_request_id_that_cannot_travel_in_metadata_is_refused(body_id):
    """It would go out as x-request-id on the next hop, where grpc refuses to send it."""
    with pytest.raises(InvalidInput) as caught:
        contextvars.copy_context().run(request_id.ensure, body_id)
    assert [v.field for v in caught.value.violations] == ["request_id"]
