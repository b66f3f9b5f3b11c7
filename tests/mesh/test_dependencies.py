"""Declared dependencies: a service gets mesh channels to what its spec names, nothing else."""

from __future__ import annotations

import pytest

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh.config import MeshSettings, ServiceSettings
from mesh.registry import discover
from mesh.server import MeshServer
from services.echo.servicer import SERVICE as ECHO_SERVICE
from tests.conftest import target

pytestmark = pytest.mark.service


async def test_a_declared_dependency_is_dialled_through_the_mesh_channel(echo_server):
    callee = await echo_server()
    settings = MeshSettings(services={"echo": ServiceSettings(port=callee.port)})
    caller = MeshServer("caller", settings, port=0, dependencies=["echo"])
    try:
        channel = caller.channel_to("echo", ECHO_SERVICE)
        assert caller.channel_to("echo", ECHO_SERVICE) is channel
        assert target(callee) in caller.channels.breakers  # one breaker per target
        reply = await echo_pb2_grpc.EchoServiceStub(channel).RelayUnary(
            echo_pb2.RelayUnaryRequest(), timeout=5
        )
        assert reply.hops[0].server == f"echo@127.0.0.1:{callee.port}"
    finally:
        await caller.channels.close()


async def test_a_callers_override_wins_over_the_services_own_target():
    settings = MeshSettings(
        services={
            "echo": ServiceSettings(target="127.0.0.1:1"),
            "caller": ServiceSettings(dependencies={"echo": "127.0.0.1:2"}),
        }
    )
    caller = MeshServer("caller", settings, port=0, dependencies=["echo"])
    try:
        caller.channel_to("echo", ECHO_SERVICE)
        assert set(caller.channels.breakers) == {"127.0.0.1:2"}
    finally:
        await caller.channels.close()


async def test_an_undeclared_dependency_is_refused():
    caller = MeshServer("caller", MeshSettings(), port=0, dependencies=["tools"])
    with pytest.raises(ValueError, match="does not declare a dependency on 'echo'"):
        caller.channel_to("echo", ECHO_SERVICE)
    assert not caller.channels.breakers


async def test_a_server_for_a_service_takes_what_its_spec_declares():
    settings = MeshSettings(services={"agent": ServiceSettings(port=0, max_queue=3)})
    server = MeshServer.for_service("agent", settings)
    spec = discover()["agent"]
    assert server.requested_port == 0
    assert server.dependencies == frozenset(spec.dependencies)
    assert server.admission.max_queue == 3
