"""The gRPC interop cases that apply to a mesh, through the full interceptor stack.

Names follow grpc/grpc doc/interop-test-descriptions.md; sizes are the ones it uses.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2
from mesh.errors import field_violations
from tests.conftest import echo_stub, eventually

pytestmark = pytest.mark.service


@pytest.fixture
async def stub(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        yield stub


async def test_empty_unary(stub):
    response = await stub.Echo(echo_pb2.EchoRequest(), timeout=5)
    assert response.payload == b""


async def test_large_unary(stub):
    response = await stub.Echo(
        echo_pb2.EchoRequest(payload=bytes(271_828), response_size=314_159), timeout=5
    )
    assert len(response.payload) == 314_159


async def test_server_streaming(stub):
    sizes = [31_415, 9, 2_653, 58_979]
    received = []
    for size in sizes:
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=1, response_size=size), timeout=5)
        received += [len(r.payload) async for r in call]
    assert received == sizes
    call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=50, response_size=10), timeout=5)
    assert [r.index async for r in call] == list(range(50))


async def test_custom_metadata(stub):
    call = stub.Echo(
        echo_pb2.EchoRequest(echo_metadata_keys=["x-grpc-test-echo-initial"]),
        metadata=(("x-grpc-test-echo-initial", "test_initial_metadata_value"),),
        timeout=5,
    )
    await call
    assert ("x-grpc-test-echo-initial", "test_initial_metadata_value") in tuple(
        await call.initial_metadata()
    )
    assert ("x-grpc-test-echo-initial", "test_initial_metadata_value") in tuple(
        await call.trailing_metadata()
    )


async def test_status_code_and_message(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Echo(
            echo_pb2.EchoRequest(
                response_status=echo_pb2.EchoStatus(code=2, message="test status message")
            ),
            timeout=5,
        )
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert caught.value.details() == "test status message"
    call = stub.EchoStream(
        echo_pb2.EchoStreamRequest(
            count=2, response_status=echo_pb2.EchoStatus(code=2, message="test status message")
        ),
        timeout=5,
    )
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for response in call:
            received.append(response)
    # A stream that fails after its first message still ends with the failing status.
    assert len(received) == 2
    assert caught.value.code() == grpc.StatusCode.UNKNOWN


async def test_special_status_message(stub):
    message = "\t\ntest with whitespace\r\nand Unicode BMP ☺ and non-BMP 😈\t\n"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Echo(
            echo_pb2.EchoRequest(response_status=echo_pb2.EchoStatus(code=2, message=message)),
            timeout=5,
        )
    assert caught.value.details() == message


async def test_unimplemented_method(echo_server):
    server = await echo_server()
    _, channel = echo_stub(server)
    async with channel:
        method = channel.unary_unary("/aimesh.echo.v1.EchoService/DoesNotExist")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await method(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_cancel_after_begin(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=10, interval_ms=100), timeout=5)
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: server.admission.in_flight == 0)


async def test_cancel_after_first_response(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=10, interval_ms=100), timeout=5)
        assert (await call.read()).index == 0
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: server.admission.in_flight == 0)


async def test_timeout_on_sleeping_server(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Echo(echo_pb2.EchoRequest(delay_ms=10_000), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server stopped sleeping too: its slot is free long before the 10 s are up.
        await eventually(lambda: server.admission.in_flight == 0, timeout_s=2.0)


async def test_bad_input_gets_every_field_violation(stub):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Echo(
            echo_pb2.EchoRequest(
                delay_ms=-1, response_size=2**31 - 1, response_status=echo_pb2.EchoStatus(code=99)
            ),
            timeout=5,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {v.field for v in field_violations(caught.value)} == {
        "delay_ms",
        "response_size",
        "response_status.code",
    }


async def test_relay_refuses_non_loopback_hops(stub):
    hops = ["example.com:443", "127.0.0.1:x", "127.0.0.1:99999", "localhost:0"]
    call = stub.Relay(echo_pb2.RelayRequest(hops=hops), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {v.field for v in field_violations(caught.value)} == {f"hops[{i}]" for i in range(4)}


async def test_concurrent_streams_on_one_channel(stub):
    async def one(n: int) -> list[int]:
        call = stub.EchoStream(echo_pb2.EchoStreamRequest(count=n, interval_ms=1), timeout=10)
        return [r.index async for r in call]

    results = await asyncio.gather(*(one(n) for n in range(1, 21)))
    assert results == [list(range(n)) for n in range(1, 21)]
