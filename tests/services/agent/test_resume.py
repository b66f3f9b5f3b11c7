"""A run survives its replica: two real agent processes on one run store (SQLite, and a
real redis-server), the first killed with SIGKILL mid-run; the second takes the run over
when the lease runs out, goes on from the last checkpoint, and the client re-attached
from its last event gets every event once.

The agents' tools and model are fakes in this test process (on loopback gRPC), so the
test decides when a tool hangs and how fast the answer streams: killing at the right
moment is then a matter of waiting for an event, not of timing.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc
from aimesh.tools.v1 import tools_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from tests.conftest import free_port, subprocess_env
from tests.harness import ServiceProcesses
from tests.services.agent.conftest import FakeTools, result

pytestmark = pytest.mark.system

LEASE_S = 1.0
ANSWER = [f"word{n} " for n in range(30)]


class KeyedTools(FakeTools):
    """FakeTools that records each call's idempotency key and hangs the first call of
    `hang_first` until cancelled."""

    def __init__(self, hang_first: bool) -> None:
        super().__init__({"knowledge_search": result("copy.deepcopy copies nested lists")})
        self.hang_first = hang_first
        self.keys: list[str] = []

    async def CallTool(self, request, context):
        self.keys.append(request.idempotency_key)
        if self.hang_first and len(self.keys) == 1:
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        async for message in super().CallTool(request, context):
            yield message


class SlowAnswer(generation_pb2_grpc.GenerationServiceServicer):
    """Answers with ANSWER word by word, 50 ms apart; plans a search of the question, then
    stops calling once results are in (the conversation ends in a tool turn)."""

    async def Chat(self, request, context):
        if request.tools and request.messages[-1].role == "user":
            query = json.dumps({"query": request.messages[-1].content})
            call = common_pb2.ToolCall(id="call_0", name="knowledge_search", arguments=query)
            complete = generation_pb2.GenerationComplete(tool_calls=[call])
            yield generation_pb2.ChatResponse(complete=complete)
            return
        if request.tools:
            yield generation_pb2.ChatResponse(chunk=generation_pb2.GenerationChunk(text="Done"))
        else:
            for word in ANSWER:
                await asyncio.sleep(0.05)
                yield generation_pb2.ChatResponse(chunk=generation_pb2.GenerationChunk(text=word))
        yield generation_pb2.ChatResponse(complete=generation_pb2.GenerationComplete())


@dataclass
class Replicas:
    processes: ServiceProcesses
    ports: dict[str, int]

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"


async def _serve(register, servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    register(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@asynccontextmanager
async def agents_on(
    tmp_path: Path, store: str, tools: KeyedTools, units: dict[str, tuple[int, dict[str, str]]]
) -> AsyncIterator[ServiceProcesses]:
    """Agent processes (label -> port and environment) on one run store, with `tools` and
    SlowAnswer as the tools service and the model; all stopped at the end."""
    tools_server, tools_target = await _serve(
        tools_pb2_grpc.add_ToolsServiceServicer_to_server, tools
    )
    model_server, model_target = await _serve(
        generation_pb2_grpc.add_GenerationServiceServicer_to_server, SlowAnswer()
    )
    config = tmp_path / "agents.toml"
    config.write_text(
        f'[services.agent]\nrun_store = "{store}"\n'
        f"lease_s = {LEASE_S}\nattach_poll_s = 0.1\n"
        f'[services.agent.dependencies]\ntools = "{tools_target}"\n'
        f'generation = "{model_target}"\n'
    )
    processes = ServiceProcesses(
        tmp_path, subprocess_env(AIMESH_CONFIG=str(config), OTEL_TRACES_EXPORTER="none")
    )
    try:
        processes.start_all([(name, "agent", port, env) for name, (port, env) in units.items()])
        yield processes
    finally:
        processes.close()
        await tools_server.stop(0)
        await model_server.stop(0)


@pytest_asyncio.fixture
async def replicas(tmp_path: Path, request) -> AsyncIterator[tuple[Replicas, KeyedTools]]:
    """Two agents on one run store: the SQLite file, or a real redis-server."""
    hang_first, kind = request.param
    store = request.getfixturevalue("redis_url") if kind == "redis" else str(tmp_path / "runs.db")
    tools = KeyedTools(hang_first=hang_first)
    ports = {"agent-a": free_port(), "agent-b": free_port()}
    units = {name: (port, {}) for name, port in ports.items()}
    async with agents_on(tmp_path, store, tools, units) as processes:
        yield Replicas(processes, ports), tools


async def _until_killed(
    replicas: Replicas, stop_at, ready: asyncio.Event | None = None
) -> list[agent_pb2.RunResponse]:
    """Runs a question on agent-a and kills it (SIGKILL) at the first event `stop_at`
    accepts (once `ready` is set, when given); the events the client saw before the
    stream broke."""
    seen: list[agent_pb2.RunResponse] = []
    async with create_channel(replicas.target("agent-a"), MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.RunRequest(question="How do I copy a nested list?")
        with pytest.raises(grpc.aio.AioRpcError):
            async for event in stub.Run(request, timeout=60):
                seen.append(event)
                if stop_at(seen):
                    if ready is not None:
                        await asyncio.wait_for(ready.wait(), 10)
                    replicas.processes.signal("agent-a", signal.SIGKILL)
                    assert await replicas.processes.wait("agent-a") == -signal.SIGKILL
    return seen


async def _reattach(replicas: Replicas, seen: list) -> list[agent_pb2.RunResponse]:
    """The rest of the run from agent-b, from the last event seen on."""
    async with create_channel(replicas.target("agent-b"), MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.AttachRequest(run_id=seen[-1].run_id, after_seq=seen[-1].seq)
        return [event async for event in stub.Attach(request, timeout=60)]


def _assert_every_event_once(events: list) -> agent_pb2.Final:
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len({e.run_id for e in events}) == 1
    assert events[-1].HasField("final")
    return events[-1].final


@pytest.mark.parametrize("replicas", [(True, "sqlite"), (True, "redis")], indirect=True)
async def test_killed_during_a_tool_call_the_run_finishes_on_the_other_replica(replicas):
    replicas, tools = replicas
    # Killed once the tool has the call: the event says the call is about to be made.
    seen = await _until_killed(replicas, lambda seen: seen[-1].HasField("tool_call"), tools.started)
    rest = await _reattach(replicas, seen)
    final = _assert_every_event_once(seen + rest)
    assert final.state == agent_pb2.RUN_STATE_ANSWERED, list(final.notes)
    assert any("resumed" in note for note in final.notes)
    # The call that never completed is made again, under the same idempotency key, so a
    # tools service that had finished it would answer from its first run.
    assert len(tools.keys) == 2 and tools.keys[0] == tools.keys[1] != ""
    results = [e.tool_result for e in rest if e.HasField("tool_result")]
    assert len(results) == 1 and not results[0].is_error
    answer = "".join(e.answer_delta.text for e in seen + rest if e.HasField("answer_delta"))
    assert answer == "".join(ANSWER)


@pytest.mark.parametrize("replicas", [(False, "sqlite"), (False, "redis")], indirect=True)
async def test_killed_during_the_answer_no_tool_call_repeats_and_no_word_twice(replicas):
    replicas, tools = replicas
    answered = lambda seen: sum(e.HasField("answer_delta") for e in seen) == 5  # noqa: E731
    seen = await _until_killed(replicas, answered)
    rest = await _reattach(replicas, seen)
    final = _assert_every_event_once(seen + rest)
    assert final.state == agent_pb2.RUN_STATE_ANSWERED, list(final.notes)
    assert len(tools.keys) == 1  # the completed call is in the checkpoint
    answer = "".join(e.answer_delta.text for e in seen + rest if e.HasField("answer_delta"))
    assert answer == "".join(ANSWER)


@pytest.mark.parametrize("replicas", [(True, "sqlite")], indirect=True)
async def test_cancel_by_id_from_another_connection_to_another_replica(replicas):
    replicas, tools = replicas
    async with (
        create_channel(replicas.target("agent-a"), MeshSettings()) as channel_a,
        create_channel(replicas.target("agent-b"), MeshSettings()) as channel_b,
    ):
        running = agent_pb2_grpc.AgentServiceStub(channel_a).Run(
            agent_pb2.RunRequest(question="How do I copy a nested list?"), timeout=60
        )
        first = await anext(aiter(running))
        await asyncio.wait_for(tools.started.wait(), 10)  # the run waits on the tool
        other = agent_pb2_grpc.AgentServiceStub(channel_b)
        cancelled = await other.Cancel(agent_pb2.CancelRequest(run_id=first.run_id), timeout=30)
        assert cancelled.state == agent_pb2.RUN_STATE_CANCELLED
        rest = [event async for event in running]
    assert rest[-1].final.state == agent_pb2.RUN_STATE_CANCELLED
    await asyncio.wait_for(tools.cancelled.wait(), 10)  # the tool call below it stopped
