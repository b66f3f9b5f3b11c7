"""The echo servicer: gRPC interop-style behaviours over the full mesh stack.

It answers the interop cases that apply to a mesh (empty and large unary, server streaming,
custom metadata, chosen status codes and messages, sleeping past a deadline) and relays a
call through a chain of echo servers so deadline, cancellation and trace propagation can be
observed hop by hop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh import caller, deadline, request_id, tracing
from mesh.errors import abort, status
from mesh.server import MeshServer
from mesh.validation import Violations

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
MAX_DELAY_MS = 60_000
MAX_COUNT = 100_000
MAX_HOPS = 8
# Relay only dials loopback: a diagnostic service must not become a proxy to anywhere.
RELAY_HOSTS = ("127.0.0.1", "localhost")

SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]


def _check_status(violations: Violations, field: str, echo_status: echo_pb2.EchoStatus) -> None:
    violations.in_range(echo_status.code, f"{field}.code", 0, 16)
    violations.max_length(echo_status.message, f"{field}.message", 4096)


def _check_stream(violations: Violations, count: int, interval_ms: int) -> None:
    violations.in_range(count, "count", 0, MAX_COUNT)
    violations.in_range(interval_ms, "interval_ms", 0, MAX_DELAY_MS)


def _check_hops(violations: Violations, hops: list[str]) -> None:
    violations.check(len(hops) <= MAX_HOPS, "hops", f"at most {MAX_HOPS} hops")
    for i, hop in enumerate(hops):
        host, _, port = hop.rpartition(":")
        violations.check(
            host in RELAY_HOSTS and port.isdigit() and 0 < int(port) < 65536,
            f"hops[{i}]",
            f"must be a loopback host:port ({', '.join(RELAY_HOSTS)}), got {hop!r}",
        )


async def _end_with(context: grpc.aio.ServicerContext, echo_status: echo_pb2.EchoStatus) -> None:
    if echo_status.code != 0:
        code = next(c for c in grpc.StatusCode if c.value[0] == echo_status.code)
        await abort(context, status(code, echo_status.message, reason="REQUESTED_BY_CALLER"))


def _deadline_ms() -> int:
    left = deadline.remaining()
    return -1 if left is None else int(left * 1000)


class EchoServicer(echo_pb2_grpc.EchoServiceServicer):
    def __init__(self, server: MeshServer) -> None:
        self.server = server

    async def Echo(
        self, request: echo_pb2.EchoRequest, context: grpc.aio.ServicerContext
    ) -> echo_pb2.EchoResponse:
        violations = Violations()
        violations.max_length(request.payload, "payload", MAX_PAYLOAD_BYTES)
        violations.in_range(request.response_size, "response_size", 0, MAX_PAYLOAD_BYTES)
        violations.in_range(request.delay_ms, "delay_ms", 0, MAX_DELAY_MS)
        _check_status(violations, "response_status", request.response_status)
        violations.raise_if_any()

        if request.echo_metadata_keys:
            wanted = set(request.echo_metadata_keys)
            echoed = tuple(
                (key, value) for key, value in context.invocation_metadata() if key in wanted
            )
            await context.send_initial_metadata(echoed)
            context.set_trailing_metadata(echoed)
        if request.delay_ms:
            await asyncio.sleep(request.delay_ms / 1000)
        await _end_with(context, request.response_status)
        payload = bytes(request.response_size) if request.response_size else request.payload
        return echo_pb2.EchoResponse(
            payload=payload,
            deadline_remaining_ms=_deadline_ms(),
            trace_id=tracing.current_trace_id(),
        )

    async def EchoStream(
        self, request: echo_pb2.EchoStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[echo_pb2.EchoStreamResponse]:
        violations = Violations()
        _check_stream(violations, request.count, request.interval_ms)
        violations.in_range(request.response_size, "response_size", 0, MAX_PAYLOAD_BYTES)
        _check_status(violations, "response_status", request.response_status)
        violations.raise_if_any()

        payload = bytes(request.response_size)
        for index in range(request.count):
            if index and request.interval_ms:
                await asyncio.sleep(request.interval_ms / 1000)
            yield echo_pb2.EchoStreamResponse(index=index, payload=payload)
        await _end_with(context, request.response_status)

    async def Relay(
        self, request: echo_pb2.RelayRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[echo_pb2.RelayResponse]:
        violations = Violations()
        _check_stream(violations, request.count, request.interval_ms)
        _check_hops(violations, request.hops)
        violations.raise_if_any()

        me = self._report()
        if request.hops:
            onward = echo_pb2.RelayRequest(
                hops=request.hops[1:], count=request.count, interval_ms=request.interval_ms
            )
            async for response in self._stub(request.hops[0]).Relay(onward):
                yield echo_pb2.RelayResponse(index=response.index, hops=[me, *response.hops])
            return
        for index in range(request.count):
            if index and request.interval_ms:
                await asyncio.sleep(request.interval_ms / 1000)
            yield echo_pb2.RelayResponse(index=index, hops=[me])

    async def RelayUnary(
        self, request: echo_pb2.RelayUnaryRequest, context: grpc.aio.ServicerContext
    ) -> echo_pb2.RelayUnaryResponse:
        violations = Violations()
        violations.in_range(request.delay_ms, "delay_ms", 0, MAX_DELAY_MS)
        _check_hops(violations, request.hops)
        violations.raise_if_any()

        me = self._report()
        if request.hops:
            onward = echo_pb2.RelayUnaryRequest(hops=request.hops[1:], delay_ms=request.delay_ms)
            response = await self._stub(request.hops[0]).RelayUnary(onward)
            return echo_pb2.RelayUnaryResponse(hops=[me, *response.hops])
        await asyncio.sleep(request.delay_ms / 1000)
        return echo_pb2.RelayUnaryResponse(hops=[me])

    def _report(self) -> echo_pb2.HopReport:
        return echo_pb2.HopReport(
            server=f"{self.server.name}@{self.server.host}:{self.server.port}",
            deadline_remaining_ms=_deadline_ms(),
            trace_id=tracing.current_trace_id(),
            request_id=request_id.current(),
            client=caller.current(),
        )

    def _stub(self, target: str) -> echo_pb2_grpc.EchoServiceStub:
        return echo_pb2_grpc.EchoServiceStub(self.server.channels.get(target, SERVICE))


async def setup(server: MeshServer) -> None:
    server.add_service(
        echo_pb2_grpc.add_EchoServiceServicer_to_server, EchoServicer(server), SERVICE
    )
