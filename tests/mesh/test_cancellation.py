"""Cancellation reaches every hop, with tracing instrumentation on."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2
from tests.conftest import echo_stub, eventually, target

pytestmark = pytest.mark.service


async def test_cancelling_a_stream_at_a_cancels_b_and_c(echo_server):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    async with channel:
        call = stub.Relay(
            echo_pb2.RelayRequest(hops=[target(b), target(c)], count=1000, interval_ms=50),
            timeout=30,
        )
        first = await call.read()
        assert [hop.server for hop in first.hops][1:] == [
            f"echo@127.0.0.1:{b.port}",
            f"echo@127.0.0.1:{c.port}",
        ]
        assert c.admission.in_flight == 1
        assert call.cancel()
        waited = await eventually(
            lambda: a.admission.in_flight == b.admission.in_flight == c.admission.in_flight == 0,
            timeout_s=3.0,
        )
        assert waited < 1.0
        assert await call.code() == grpc.StatusCode.CANCELLED


async def test_cancelling_the_callers_task_cancels_a_unary_chain(echo_server):
    """The aio tracing interceptor alone would leave this RPC running (contrib #3271)."""
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)

    async def call() -> echo_pb2.RelayUnaryResponse:
        return await stub.RelayUnary(
            echo_pb2.RelayUnaryRequest(hops=[target(b), target(c)], delay_ms=30_000),
            timeout=60,
        )

    async with channel:
        task = asyncio.create_task(call())
        await eventually(lambda: c.admission.in_flight == 1, timeout_s=3.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        waited = await eventually(
            lambda: a.admission.in_flight == b.admission.in_flight == c.admission.in_flight == 0,
            timeout_s=3.0,
        )
        assert waited < 1.0


async def test_cancelling_the_callers_task_cancels_a_stream_chain(echo_server):
    a, b, c = await asyncio.gather(echo_server(), echo_server(), echo_server())
    stub, channel = echo_stub(a)
    received: list[echo_pb2.RelayResponse] = []

    async def consume() -> None:
        call = stub.Relay(
            echo_pb2.RelayRequest(hops=[target(b), target(c)], count=1000, interval_ms=50),
            timeout=30,
        )
        async for response in call:
            received.append(response)

    async with channel:
        task = asyncio.create_task(consume())
        await eventually(lambda: len(received) >= 2, timeout_s=3.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(
            lambda: a.admission.in_flight == b.admission.in_flight == c.admission.in_flight == 0,
            timeout_s=3.0,
        )
