"""Deadline propagation across a real 3-hop chain A -> B -> C."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2
from mesh import deadline
from mesh.errors import error_info
from tests.conftest import echo_stub, eventually, target

pytestmark = pytest.mark.service


async def test_budget_shrinks_at_every_hop_streaming(echo_server):
    a, b, c = echo_server(), echo_server(), echo_server()
    a, b, c = await asyncio.gather(a, b, c)
    stub, channel = echo_stub(a)
    async with channel:
        call = stub.Relay(
            echo_pb2.RelayRequest(hops=[target(b), target(c)], count=2, interval_ms=50),
            timeout=5.0,
        )
        responses = [r async for r in call]
    assert len(responses) == 2
    at_a, at_b, at_c = (hop.deadline_remaining_ms for hop in responses[0].hops)
    assert 0 < at_c < at_b < at_a <= 5000 * 1.01  # grpc-timeout rounds up slightly
    # Each hop keeps a margin (10 ms + 1% of the budget) that wire rounding cannot eat.
    assert at_a - at_b >= 10 and at_b - at_c >= 10


async def test_budget_shrinks_at_every_hop_unary(echo_server):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        response = await stub.RelayUnary(
            echo_pb2.RelayUnaryRequest(hops=[target(b), target(c)]), timeout=3.0
        )
    at_a, at_b, at_c = (hop.deadline_remaining_ms for hop in response.hops)
    assert 0 < at_c < at_b < at_a <= 3000 * 1.01
    assert at_a - at_b >= 10 and at_b - at_c >= 10


async def test_expiry_cancels_every_hop_and_caller_sees_deadline_exceeded(echo_server):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        call = stub.Relay(
            # 100 messages, 100 ms apart: 10 s of work under a 1 s budget.
            echo_pb2.RelayRequest(hops=[target(b), target(c)], count=100, interval_ms=100),
            timeout=1.0,
        )
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                received += 1
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 5 <= received <= 11
        # Every hop's handler stopped: its admission slot is free again, promptly.
        waited = await eventually(
            lambda: a.admission.in_flight == b.admission.in_flight == c.admission.in_flight == 0,
            timeout_s=5.0,
        )
        assert waited < 3.0


async def test_unary_chain_expiry_stops_the_sleeping_last_hop(echo_server):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RelayUnary(
                echo_pb2.RelayUnaryRequest(hops=[target(b), target(c)], delay_ms=30_000),
                timeout=0.5,
            )
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Every hop lets go of its slot (generous bound: the machine may be busy).
        await eventually(
            lambda: a.admission.in_flight == b.admission.in_flight == c.admission.in_flight == 0,
            timeout_s=5.0,
        )


async def test_call_without_deadline_gets_the_default(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        response = await stub.Echo(echo_pb2.EchoRequest())
    # MeshSettings().client.default_unary_deadline_s is 10 s; grpc-timeout encoding rounds
    # long timeouts up (10 s arrives as about 10.1 s).
    assert 9_000 < response.deadline_remaining_ms <= 10_200


async def test_budget_scope_bounds_calls_made_inside_it(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        with deadline.budget(2.0):
            response = await stub.Echo(echo_pb2.EchoRequest(), timeout=60)
    assert 1_000 < response.deadline_remaining_ms <= 2_000


async def test_spent_budget_fails_locally_without_calling(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        with deadline.budget(0.005):
            await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Echo(echo_pb2.EchoRequest())
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = error_info(caught.value)
    assert info is not None and info.reason == "BUDGET_SPENT" and info.domain == "aimesh"
    assert server.admission.in_flight == 0
