"""Circuit breaker: the state machine on a fake clock, then against a real server."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2
from mesh.breaker import CircuitBreaker, Outcome, State, classify
from mesh.config import BreakerSettings, ClientSettings, MeshSettings
from mesh.errors import error_info, local_error, passed_through, retry_delay_s, status
from tests.conftest import echo_stub, metric, target

pytestmark = pytest.mark.service

SETTINGS = BreakerSettings(
    window_size=4,
    minimum_calls=4,
    failure_rate=0.5,
    slow_call_s=1.0,
    open_wait_s=0.3,
    half_open_calls=2,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(settings: BreakerSettings = SETTINGS) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker("test-target", settings, clock=clock), clock


@pytest.mark.parametrize(
    ("code", "timeout", "expected"),
    [
        (grpc.StatusCode.OK, None, Outcome.SUCCESS),
        (grpc.StatusCode.UNAVAILABLE, None, Outcome.FAILURE),
        # A live target's answer to one request's content: no one else's failure.
        (grpc.StatusCode.INTERNAL, None, Outcome.IGNORED),
        (grpc.StatusCode.UNKNOWN, None, Outcome.IGNORED),
        (grpc.StatusCode.DATA_LOSS, None, Outcome.FAILURE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 5.0, Outcome.FAILURE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 0.05, Outcome.IGNORED),
        (grpc.StatusCode.INVALID_ARGUMENT, None, Outcome.IGNORED),
        (grpc.StatusCode.NOT_FOUND, None, Outcome.IGNORED),
        (grpc.StatusCode.CANCELLED, None, Outcome.IGNORED),
        (grpc.StatusCode.UNAUTHENTICATED, None, Outcome.IGNORED),
        (grpc.StatusCode.PERMISSION_DENIED, None, Outcome.IGNORED),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, None, Outcome.IGNORED),
    ],
)
def test_classification(code, timeout, expected):
    assert classify(code, timeout, SETTINGS) is expected


def test_a_stream_out_of_time_is_its_callers_failure_not_the_targets():
    """A generation longer than its caller's budget ends in DEADLINE_EXCEEDED: counted, a
    few of them opened the router's decode breaker for every other caller."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    assert classify(code, 5.0, SETTINGS, streaming=True) is Outcome.IGNORED
    assert classify(grpc.StatusCode.UNAVAILABLE, 5.0, SETTINGS, streaming=True) is Outcome.FAILURE


def test_trips_on_failure_rate_and_fails_fast_while_open():
    b, _ = breaker()
    for outcome in (Outcome.SUCCESS, Outcome.FAILURE, Outcome.SUCCESS):
        assert b.before_call("m") is None
        b.record(outcome, 0.01)
    assert b.state is State.CLOSED  # 3 calls < minimum_calls
    b.record(Outcome.FAILURE, 0.01)  # 2 of 4 failed = 50%
    assert b.state is State.OPEN
    refusal = b.before_call("m")
    assert refusal is not None and refusal.code == grpc.StatusCode.UNAVAILABLE


def test_ignored_outcomes_never_trip():
    b, _ = breaker()
    for _ in range(50):
        b.record(Outcome.IGNORED, 0.01)
    assert b.state is State.CLOSED


def test_slow_calls_trip_but_slow_streams_do_not():
    b, _ = breaker()
    for _ in range(4):
        b.record(Outcome.SUCCESS, 30.0, streaming=True)
    assert b.state is State.CLOSED
    for _ in range(4):
        b.record(Outcome.SUCCESS, 2.0)
    assert b.state is State.OPEN


def test_half_open_after_wait_then_closes_on_success():
    b, clock = breaker()
    for _ in range(4):
        b.record(Outcome.FAILURE, 0.01)
    assert b.state is State.OPEN
    clock.now += 0.31
    assert b.state is State.HALF_OPEN
    assert b.before_call("m") is None and b.before_call("m") is None
    assert b.before_call("m") is not None  # only half_open_calls trial calls at once
    b.record(Outcome.SUCCESS, 0.01)
    b.record(Outcome.SUCCESS, 0.01)
    assert b.state is State.CLOSED


def test_half_open_reopens_on_failures():
    b, clock = breaker()
    for _ in range(4):
        b.record(Outcome.FAILURE, 0.01)
    clock.now += 0.31
    assert b.before_call("m") is None and b.before_call("m") is None
    b.record(Outcome.FAILURE, 0.01)
    b.record(Outcome.SUCCESS, 0.01)
    assert b.state is State.OPEN


def test_backpressure_holds_calls_without_tripping():
    b, clock = breaker()
    b.push_back(0.5)
    refusal = b.before_call("m")
    assert refusal is not None and refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert b.state is State.CLOSED
    clock.now += 0.51
    assert b.before_call("m") is None


@pytest.mark.parametrize(("reason", "held"), [("QUEUE_FULL", True), ("DEADLINE_TOO_SHORT", False)])
def test_only_the_targets_own_overload_holds_every_caller(reason, held):
    """A refusal for one caller's too-short deadline says nothing of the target's capacity."""
    b, _ = breaker()
    refusal = local_error(
        status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", reason=reason, retry_after_s=0.5)
    )
    b.record_status(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, 0.01, 5.0, streaming=False)
    assert (b.before_call("m") is not None) is held


def _client_settings() -> MeshSettings:
    return MeshSettings(client=ClientSettings(breaker=SETTINGS))


def _handled(code: str) -> float:
    return metric(
        "aimesh_rpc_server_handled_total",
        grpc_service="aimesh.echo.v1.EchoService",
        grpc_method="Echo",
        grpc_code=code,
    )


def _state(server) -> float:
    return metric("aimesh_breaker_state", target=target(server))


async def test_real_server_trips_fails_fast_half_opens_and_closes(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server, _client_settings())
    internal = echo_pb2.EchoRequest(response_status=echo_pb2.EchoStatus(code=13, message="boom"))
    unavailable = echo_pb2.EchoRequest(
        response_status=echo_pb2.EchoStatus(code=14, message="going away")
    )
    async with channel:
        # INVALID_ARGUMENT is the caller's fault, INTERNAL one request's bug: a dozen of
        # each leave the breaker closed for everyone else.
        for bad, code in (
            (echo_pb2.EchoRequest(delay_ms=-1), grpc.StatusCode.INVALID_ARGUMENT),
            (internal, grpc.StatusCode.INTERNAL),
        ):
            for _ in range(12):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Echo(bad, timeout=5)
                assert caught.value.code() == code
        assert _state(server) == State.CLOSED
        for _ in range(4):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Echo(unavailable, timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

        served_before = _handled("OK")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Echo(echo_pb2.EchoRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        info = error_info(caught.value)
        assert info.reason == "CIRCUIT_OPEN" and info.domain == "aimesh"
        assert retry_delay_s(caught.value) <= SETTINGS.open_wait_s
        assert _handled("OK") == served_before  # failed locally: the server never saw it
        assert _state(server) == State.OPEN

        await asyncio.sleep(SETTINGS.open_wait_s + 0.05)
        for _ in range(SETTINGS.half_open_calls):
            await stub.Echo(echo_pb2.EchoRequest(), timeout=5)
        assert _handled("OK") == served_before + SETTINGS.half_open_calls
        assert _state(server) == State.CLOSED
        for _ in range(5):
            await stub.Echo(echo_pb2.EchoRequest(), timeout=5)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_failure_passed_up_from_further_down_does_not_trip_the_callers_breaker(
    echo_server,
):
    """A relays to a hop that is down: A's own breaker for that hop opens, but A answered
    every call, so its callers keep calling A (the chaos suite saw such breakers hold a
    healthy path shut for seconds after the dependency was back)."""
    server = await echo_server()
    dead = f"127.0.0.1:{_unused_port()}"
    stub, channel = echo_stub(server, _client_settings())
    async with channel:
        for _ in range(3 * SETTINGS.window_size):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.RelayUnary(echo_pb2.RelayUnaryRequest(hops=[dead]), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert passed_through(caught.value)
        assert _state(server) == State.CLOSED
        assert server.channels.breakers[dead].state is not State.CLOSED
        reply = await stub.RelayUnary(echo_pb2.RelayUnaryRequest(), timeout=5)
        assert len(reply.hops) == 1


async def test_streams_that_fail_trip_the_breaker(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server, _client_settings())
    failing = echo_pb2.EchoStreamRequest(
        count=2, response_status=echo_pb2.EchoStatus(code=14, message="going away")
    )
    async with channel:
        for _ in range(4):
            call = stub.EchoStream(failing, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in call:
                    pass
        # The outcome of a stream is recorded from its done callback, a moment later.
        for _ in range(100):
            try:
                await stub.Echo(echo_pb2.EchoRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:
                assert error_info(error).reason == "CIRCUIT_OPEN"
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("breaker did not open after failing streams")


async def test_unavailable_is_retried_only_for_idempotent_methods(echo_server):
    server = await echo_server()
    stub, channel = echo_stub(server)
    unavailable = echo_pb2.EchoStatus(code=14, message="try again")
    async with channel:
        before = _handled("UNAVAILABLE")
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Echo(echo_pb2.EchoRequest(response_status=unavailable), timeout=10)
        # Echo is NO_SIDE_EFFECTS in the proto: the service config retries it 3 times.
        assert _handled("UNAVAILABLE") == before + 3
