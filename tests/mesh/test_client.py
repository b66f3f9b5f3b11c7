"""The channel factory: round_robin over every address, retries only where the proto allows."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from aimesh.llm.v1 import decode_pb2, kv_cache_pb2
from aimesh.retrieval.v1 import retrieval_pb2
from mesh.client import channel_options, create_channel, idempotent_methods, service_config
from mesh.config import ClientSettings, MeshSettings, ServiceSettings
from mesh.registry import discover
from mesh.server import MeshServer
from services.echo.servicer import SERVICE as ECHO_SERVICE

pytestmark = pytest.mark.service


def test_retries_come_from_the_protos_idempotency_levels():
    services = [
        decode_pb2.DESCRIPTOR.services_by_name["DecodeService"],
        kv_cache_pb2.DESCRIPTOR.services_by_name["KvCacheService"],
        retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"],
    ]
    safe = set(idempotent_methods(services))
    assert ("aimesh.llm.v1.KvCacheService", "Pull") in safe
    assert ("aimesh.llm.v1.DecodeService", "GetLoad") in safe
    # Decode has side effects (it takes a batch slot); Upsert is a client stream.
    assert ("aimesh.llm.v1.DecodeService", "Decode") not in safe
    assert ("aimesh.retrieval.v1.RetrievalService", "Upsert") not in safe

    config = service_config(services, ClientSettings())
    (method_config,) = config["methodConfig"]
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert config["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]


def test_reconnect_backoff_is_capped_well_below_grpcs_two_minutes():
    """grpc's default reconnect backoff reaches 120 s: a callee that was down for a minute
    would be found again up to ~40 s after it came back (the chaos suite saw it)."""
    options = dict(channel_options(MeshSettings()))
    assert options["grpc.max_reconnect_backoff_ms"] <= 5000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
    tuned = MeshSettings(client=ClientSettings(reconnect_max_backoff_s=0.25))
    assert dict(channel_options(tuned))["grpc.max_reconnect_backoff_ms"] == 250


async def test_round_robin_spreads_calls_over_every_address(echo_server):
    a, b = await asyncio.gather(echo_server(), echo_server())
    target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
    channel = create_channel(target, MeshSettings(), services=[ECHO_SERVICE])
    async with channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        await channel.channel_ready()
        served = set()
        for _ in range(20):
            response = await stub.RelayUnary(echo_pb2.RelayUnaryRequest(), timeout=5)
            served.add(response.hops[0].server)
    assert served == {f"echo@127.0.0.1:{a.port}", f"echo@127.0.0.1:{b.port}"}


async def test_a_new_channel_reaches_a_new_server_on_an_address_an_old_channel_saw_refused():
    """grpc's global subchannel pool hands a new channel the subchannel of any channel with
    the same address and options. A channel left pointing at a stopped server keeps that
    subchannel in reconnect backoff, and a server started later on the same port (an
    ephemeral port reused, a restarted pod) was then refused to the new channel's first
    call: the gateway tests saw 503 "Connection refused" from a fake that was listening."""

    async def echo_on(port: int) -> MeshServer:
        settings = MeshSettings(services={"echo": ServiceSettings()})
        server = MeshServer.for_service("echo", settings, port=port)
        await discover()["echo"].load_setup()(server)
        await server.start()
        return server

    first = await echo_on(0)
    port = first.port
    stale = create_channel(f"127.0.0.1:{port}", MeshSettings(), services=[ECHO_SERVICE])
    request = echo_pb2.RelayUnaryRequest()
    await echo_pb2_grpc.EchoServiceStub(stale).RelayUnary(request, timeout=5)
    await first.drain(0)
    with pytest.raises(grpc.aio.AioRpcError):  # the stale channel sees the refusal
        await echo_pb2_grpc.EchoServiceStub(stale).RelayUnary(request, timeout=5)
    second = await echo_on(port)
    fresh = create_channel(f"127.0.0.1:{port}", MeshSettings(), services=[ECHO_SERVICE])
    try:
        answer = await echo_pb2_grpc.EchoServiceStub(fresh).RelayUnary(request, timeout=5)
        assert answer.hops[0].server == f"echo@127.0.0.1:{port}"
    finally:
        await fresh.close()
        await stale.close()
        await second.drain(0)
