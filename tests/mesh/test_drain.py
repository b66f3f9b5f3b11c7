"""SIGTERM drains a real `aimesh serve` process: in-flight streams finish, new calls are
refused, and the process exits within its grace period."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh.health import probe

pytestmark = pytest.mark.service


async def test_sigterm_lets_in_flight_stream_finish_and_refuses_new_calls(serve_process):
    child = await serve_process("echo", grace_s="10")
    async with grpc.aio.insecure_channel(child.target) as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        # 10 messages, 200 ms apart: about 2 s of streaming.
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=10, interval_ms=200), timeout=30)
        assert (await call.read()).index == 0
        terminated_at = time.monotonic()
        child.signal(signal.SIGTERM)

        # New calls are refused (a new connection finds the listener closed)...
        await asyncio.sleep(0.3)
        async with grpc.aio.insecure_channel(child.target) as fresh:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await echo_pb2_grpc.EchoServiceStub(fresh).Echo(echo_pb2.EchoRequest(), timeout=1)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

        # ...while the stream that was in flight runs to its end, OK.
        rest = [r.index for r in await read_rest(call)]
        assert rest == list(range(1, 10))
        assert await call.code() == grpc.StatusCode.OK

    returncode = await asyncio.wait_for(child.wait(), timeout=15)
    assert returncode == 0
    assert time.monotonic() - terminated_at < 10


async def test_readiness_goes_not_serving_while_draining(serve_process):
    child = await serve_process("echo", grace_s="10")
    async with grpc.aio.insecure_channel(child.target) as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=5, interval_ms=300), timeout=30)
        await call.read()
        child.signal(signal.SIGTERM)
        # The health service answers on the existing connection while the stream drains.
        statuses = set()
        for _ in range(10):
            statuses.add(await probe(child.target, "echo"))
            if "NOT_SERVING" in statuses or "UNREACHABLE" in statuses:
                break
            await asyncio.sleep(0.05)
        assert statuses & {"NOT_SERVING", "UNREACHABLE"}
        assert [r.index for r in await read_rest(call)] == [1, 2, 3, 4]
    assert await asyncio.wait_for(child.wait(), timeout=15) == 0


async def test_stream_longer_than_grace_is_cut_at_the_grace_period(serve_process):
    child = await serve_process("echo", grace_s="1")
    async with grpc.aio.insecure_channel(child.target) as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=100, interval_ms=100), timeout=30)
        await call.read()
        terminated_at = time.monotonic()
        child.signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError):
            await read_rest(call)
    assert await asyncio.wait_for(child.wait(), timeout=10) == 0
    assert time.monotonic() - terminated_at < 5


async def read_rest(call) -> list:
    """Reads a stream to its end with read(): plain channels forbid mixing it with async for."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages
