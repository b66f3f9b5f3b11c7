"""MCP servers mounted in the agent (services/agent/mcp_mounts.py), with real servers: the
index's `mcp-server-time` (stdio), aimesh's own /mcp (Streamable HTTP with a key file),
and a scripted one for the faults (tests/services/agent/mcp_faults_server.py): a call
that hangs, a 10 MB result, an invalid schema, a server killed mid-call, a server that
never starts. The loop plans with a scripted model (tests/services/agent/test_loop.py)."""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from aimesh.agent.v1 import agent_pb2
from mesh.config import BreakerSettings
from mesh.info import get_info
from services.agent import loop
from services.agent.mcp_mounts import Mount, MountedTools
from services.agent.planner import ToolStep
from services.agent.settings import AgentSettings, McpServerSettings
from tests.conftest import eventually
from tests.services.agent.conftest import FakeGeneration as ServiceGeneration
from tests.services.agent.conftest import FakeTools as ServiceTools
from tests.services.agent.conftest import final, run_all
from tests.services.agent.test_loop import FakeGeneration, FakeTools, answer, run
from tests.services.gateway.test_mcp import mcp_gateway

pytestmark = pytest.mark.service

TIME_SERVER = shutil.which("mcp-server-time") or f"{sys.prefix}/bin/mcp-server-time"
FAULTS = [sys.executable, "-m", "tests.services.agent.mcp_faults_server"]
# How long a mount may take to start its server and connect: a Python child importing the
# SDK takes about a second here.
CONNECT_S = 60


async def health_of(health: HealthServicer, mount: Mount) -> int:
    request = health_pb2.HealthCheckRequest(service=mount.health_name)
    return (await health.Check(request, None)).status


@asynccontextmanager
async def mounted(
    *servers: McpServerSettings, health: HealthServicer | None = None
) -> AsyncIterator[list[Mount]]:
    mounts = [Mount(server, BreakerSettings(), health) for server in servers]
    for mount in mounts:
        mount.start()
    try:
        yield mounts
    finally:
        for mount in mounts:
            await mount.stop()


def time_server(**settings: object) -> McpServerSettings:
    command = [TIME_SERVER, "--local-timezone", "UTC"]
    return McpServerSettings(name="time", command=command, **settings)


async def test_the_agent_answers_through_a_third_party_mcp_server():
    """mcp-server-time, from the package index, mounted over stdio: its tools join the
    tools service's, the model's call of one runs there, and the answer is made from
    its result."""
    health = HealthServicer()
    async with mounted(time_server(), health=health) as mounts:
        tools = MountedTools(FakeTools({"calculator": (False, "4", {"value": 4})}), mounts)
        listed = await tools.list(CONNECT_S)
        assert {"calculator", "time__get_current_time", "time__convert_time"} <= set(listed.tools)
        assert await health_of(health, mounts[0]) == health_pb2.HealthCheckResponse.SERVING
        schema = listed.tools["time__convert_time"].input_schema
        assert schema["required"] == ["source_timezone", "time", "target_timezone"]
        convert = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}
        generation = FakeGeneration([[("time__convert_time", convert)]], answer="21:00 in Tokyo.")
        events, state = await run(
            tools, generation, "It is 12:00 in UTC. What time is it in Asia/Tokyo?"
        )
    (observation,) = state.observations
    assert not observation.is_error, observation.text
    assert observation.structured["target"]["datetime"].endswith("T21:00:00+09:00")
    assert "21:00:00+09:00" in generation.prompts[0]
    assert answer(events) == "21:00 in Tokyo."
    assert state.planner == loop.Planner.MODEL and not state.shortfalls


async def test_an_allow_list_offers_only_the_tools_it_names():
    async with mounted(time_server(allowed_tools=["convert_time", "no_such"])) as mounts:
        listed = await MountedTools(FakeTools({}), mounts).list(CONNECT_S)
    assert set(listed.tools) == {"time__convert_time"}
    assert listed.notes == ("MCP server time lists no tool no_such",)


async def test_aimesh_tools_mount_over_streamable_http_with_a_key_file(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-tools\n")
    async with mcp_gateway(tmp_path) as gateway:
        server = McpServerSettings(name="aimesh", url=f"{gateway.url}/mcp", key_file=key_file)
        async with mounted(server) as mounts:
            tools = MountedTools(FakeTools({}), mounts)
            listed = await tools.list(CONNECT_S)
            assert "aimesh__calculator" in listed.tools
            step = ToolStep("aimesh__calculator", {"expression": "17 * 23"}, "test")
            observation = await tools.call(step, 30)
            (mount,) = mounts
            assert mount.info.connected and mount.info.address == f"{gateway.url}/mcp"
    assert not observation.is_error and observation.structured["value"] == 391


async def test_faults_cost_the_call_or_a_note_never_the_run():
    faults = McpServerSettings(name="faults", command=FAULTS, max_result_bytes=1024 * 1024)
    # The same server with a short limit on each call, for the one that hangs.
    hasty = McpServerSettings(name="hasty", command=FAULTS, call_timeout_s=1.0)
    async with mounted(faults, hasty) as mounts:
        tools = MountedTools(FakeTools({}), mounts)
        listed = await tools.list(CONNECT_S)
        assert {"faults__echo", "faults__hang", "faults__huge", "faults__die"} <= set(listed.tools)
        # An invalid schema and a name no model may call are skipped, each with a note.
        assert "faults__broken" not in listed.tools
        assert any("broken: its input schema is invalid" in n for n in listed.notes)
        assert any("not.a.function" in n and "no function name" in n for n in listed.notes)

        def step(name: str, server: str = "faults", **arguments: object) -> ToolStep:
            return ToolStep(f"{server}__{name}", arguments, "test")

        # A hung call ends at the server's limit, not the run's (30 s here).
        started = asyncio.get_running_loop().time()
        with pytest.raises(loop.Unavailable) as hung:
            await tools.call(step("hang", "hasty"), 30)
        assert hung.value.reason == "DEADLINE_EXCEEDED"
        assert asyncio.get_running_loop().time() - started < 20

        too_large = await tools.call(step("huge"), 30)
        assert too_large.is_error and "over the limit of 1048576" in too_large.text

        failed = await tools.call(step("fail"), 30)
        assert failed.is_error and failed.text == "the tool could not do it"

        first = await tools.call(step("echo", text="one"), 30)
        assert not first.is_error
        with pytest.raises(loop.Unavailable) as died:
            await tools.call(step("die"), 30)
        assert died.value.reason == "UNAVAILABLE"

        # The mount starts the server again; the next run's listing and calls find it.
        async def echoed() -> str:
            while True:
                try:
                    await tools.list(CONNECT_S)
                    return (await tools.call(step("echo", text="two"), 30)).text
                except loop.Unavailable:
                    await asyncio.sleep(0.2)

        again = await asyncio.wait_for(echoed(), CONNECT_S)
        assert again.endswith(": two") and again.split(":")[0] != first.text.split(":")[0]


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
async def test_a_server_that_says_its_tools_changed_is_listed_again(protocol):
    """At 2026-07-28 (auto, with this server) through subscriptions/listen; at
    2025-11-25 (legacy) through notifications/tools/list_changed."""
    faults = McpServerSettings(name="faults", command=FAULTS, protocol=protocol)
    async with mounted(faults) as mounts:
        tools = MountedTools(FakeTools({}), mounts)
        assert "faults__grown" not in (await tools.list(CONNECT_S)).tools
        grew = await tools.call(ToolStep("faults__grow", {}, "test"), 30)
        assert grew.text == "grown"

        async def listed_again() -> bool:
            return "faults__grown" in (await tools.list(CONNECT_S)).tools

        await eventually(listed_again, timeout_s=CONNECT_S, interval_s=0.1)


async def test_a_server_that_never_starts_is_a_note_and_the_other_tools_serve():
    never = McpServerSettings(name="never", command=["/nonexistent/mcp-server"])
    settings = AgentSettings(mcp_servers=[never])
    health = HealthServicer()
    async with mounted(never, health=health) as mounts:
        tools = MountedTools(FakeTools({"calculator": (False, "42", {"value": 42})}), mounts)
        generation = FakeGeneration([[("calculator", {"expression": "6*7"})]])
        events, state = await run(tools, generation, "What is 6*7?", 30, settings)
        assert await health_of(health, mounts[0]) == health_pb2.HealthCheckResponse.NOT_SERVING
        info = mounts[0].info
        assert not info.connected and info.problem and info.address == "/nonexistent/mcp-server"
    assert [o.step.name for o in state.observations] == ["calculator"]
    (note,) = [n for n in state.notes if n.startswith("MCP server never unavailable")]
    assert "its tools unused" in note
    assert answer(events) == "An answer."


def test_getinfo_shows_where_a_server_is_without_what_may_be_secret():
    url = "http://user:secret@127.0.0.1:9000/mcp?token=secret"
    shown = Mount(McpServerSettings(name="crm", url=url), BreakerSettings()).info
    assert (shown.name, shown.protocol, shown.address) == (
        "crm",
        "mcp",
        "http://127.0.0.1:9000/mcp",
    )
    command = ["mcp-server", "--token", "secret"]
    assert Mount(McpServerSettings(name="x", command=command), BreakerSettings()).info.address == (
        "mcp-server"
    )


def test_a_server_needs_exactly_one_transport_and_a_unique_name():
    with pytest.raises(ValueError, match="either url or command"):
        McpServerSettings(name="both", url="http://127.0.0.1:1/mcp", command=["x"])
    with pytest.raises(ValueError, match="either url or command"):
        McpServerSettings(name="neither")
    with pytest.raises(ValueError, match="names must be unique"):
        AgentSettings(mcp_servers=[time_server(), time_server()])
    with pytest.raises(ValueError):
        McpServerSettings(name="Has.Dots", command=["x"])


async def test_the_agent_service_answers_through_a_mounted_server_and_getinfo_lists_it(
    start_agent,
):
    """The whole agent service (scripted model and tools service on loopback gRPC) with
    mcp-server-time mounted from its settings: the run calls it, and GetInfo says so."""
    convert = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}
    agent = await start_agent(
        ServiceTools({}),
        ServiceGeneration([[("time__convert_time", convert)]], answer="21:00 in Tokyo."),
        mcp_servers=[time_server()],
    )
    target = f"127.0.0.1:{agent.server.port}"

    async def connected() -> bool:
        info = await get_info(target, timeout_s=10)
        return info is not None and all(s.connected for s in info.external_servers)

    await eventually(connected, timeout_s=CONNECT_S, interval_s=0.1)
    (listed,) = (await get_info(target, timeout_s=10)).external_servers
    assert (listed.name, listed.protocol, listed.address) == ("time", "mcp", TIME_SERVER)

    events = await run_all(agent, "It is 12:00 in UTC. What time is it in Asia/Tokyo?")
    (called,) = [e.tool_result for e in events if e.HasField("tool_result")]
    assert called.name == "time__convert_time" and not called.is_error, called
    ended = final(events)
    assert ended.state == agent_pb2.RUN_STATE_ANSWERED, ended.notes
