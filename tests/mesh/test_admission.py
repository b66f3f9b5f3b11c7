"""Admission: bounded concurrency and queue, fast RESOURCE_EXHAUSTED with RetryInfo."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2
from mesh.errors import error_info, retry_delay_s
from mesh.health import probe
from tests.conftest import echo_stub, eventually, target

pytestmark = pytest.mark.service

SLOW = echo_pb2.EchoRequest(delay_ms=1500)


async def test_past_concurrency_and_queue_calls_are_refused_at_once(echo_server):
    server = await echo_server(max_concurrency=1, max_queue=1)
    stub, channel = echo_stub(server)
    async with channel:
        running = asyncio.create_task(_call(stub, SLOW))
        queued = asyncio.create_task(_call(stub, SLOW))
        await eventually(lambda: server.admission.in_flight == 1 and server.admission.waiting == 1)

        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Echo(echo_pb2.EchoRequest(), timeout=10)
        refused_in = time.monotonic() - started
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused_in < 0.5
        assert error_info(caught.value).reason == "QUEUE_FULL"
        assert retry_delay_s(caught.value) > 0
        # Readiness probes bypass admission: a saturated server still answers them.
        assert await probe(target(server), "echo") == "SERVING"

        # The queued call was only delayed, never dropped.
        await running
        await queued
        assert server.admission.in_flight == server.admission.waiting == 0


async def test_call_cancelled_in_the_queue_gives_its_place_back(echo_server):
    server = await echo_server(max_concurrency=1, max_queue=1)
    stub, channel = echo_stub(server)
    async with channel:
        running = asyncio.create_task(_call(stub, SLOW))
        await eventually(lambda: server.admission.in_flight == 1)
        queued = asyncio.create_task(_call(stub, SLOW))
        await eventually(lambda: server.admission.waiting == 1)
        queued.cancel()
        await eventually(lambda: server.admission.waiting == 0)
        # Its place is free: another call can queue instead of being refused.
        replacement = asyncio.create_task(_call(stub, echo_pb2.EchoRequest()))
        await eventually(lambda: server.admission.waiting == 1)
        await running
        await replacement
        assert server.admission.in_flight == 0


async def test_deadline_too_short_for_predicted_wait_is_refused_early(echo_server):
    server = await echo_server(max_concurrency=1, max_queue=8)
    stub, channel = echo_stub(server)
    async with channel:
        for _ in range(5):  # teach the predictor: Echo holds its slot ~200 ms
            await stub.Echo(echo_pb2.EchoRequest(delay_ms=200), timeout=5)
        running = asyncio.create_task(_call(stub, echo_pb2.EchoRequest(delay_ms=200)))
        await eventually(lambda: server.admission.in_flight == 1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Echo(echo_pb2.EchoRequest(delay_ms=200), timeout=0.1)
        # Refused before its deadline, not at it: a deadline reached is DEADLINE_EXCEEDED.
        # (A bound on the wall time flaked on a busy machine: 127 ms against 90.)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(caught.value).reason == "DEADLINE_TOO_SHORT"
        await running


async def _call(stub, request: echo_pb2.EchoRequest) -> echo_pb2.EchoResponse:
    return await stub.Echo(request, timeout=10)
