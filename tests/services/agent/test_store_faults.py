"""The agent outlives its run store's faults: two real agent processes on one store, the
store made to fail for real: a redis-server killed (-9) and started again with its data,
or the SQLite file's write lock held by another process past busy_timeout (the store's
writes fail as they do when its disk is full: an injected failure at the store's edge).

Neither replica exits; each says the store is failing (the `agent.run_store` health name
NOT_SERVING, aimesh_store_state) and serving again once it answers. A run whose lease
could not be renewed through the fault is stopped where it ran (its stream ends
UNAVAILABLE, saying to re-attach) and goes on once, where it is claimed after: every
event once, one Final, the interrupted tool call made again under its idempotency key.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from loadtest.chaos_mesh import RedisProcess, sqlite_write_lock
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.health import probe
from tests.conftest import free_port
from tests.harness import ServiceProcesses
from tests.services.agent.test_resume import ANSWER, KeyedTools, agents_on

pytestmark = pytest.mark.system

LEASE_S = 1.0
HEALTH_NAME = "agent.run_store"
REPLICAS = ("agent-a", "agent-b")
# Longer than a lease, with room for the renewals before it.
OUTAGE_S = 4 * LEASE_S


@dataclass
class Agents:
    processes: ServiceProcesses
    ports: dict[str, int]
    tools: KeyedTools
    fault: Callable[[], contextlib.AbstractContextManager[None]]

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def alive(self) -> dict[str, int | None]:
        return {name: self.processes.children[name].process.returncode for name in REPLICAS}

    async def health(self, name: str) -> str:
        return await probe(self.target(name), HEALTH_NAME, timeout_s=5)

    def store_state(self, name: str) -> str:
        url = f"http://127.0.0.1:{self.ports[name + '_metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        states = [
            line.split('state="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith('aimesh_store_state{') and 'store="run_store"' in line
            and line.endswith(" 1.0")
        ]  # fmt: skip
        return ",".join(states)


@contextlib.contextmanager
def redis_down(redis: RedisProcess) -> Iterator[None]:
    redis.kill()
    try:
        yield
    finally:
        redis.start()


@pytest_asyncio.fixture
async def agents(tmp_path: Path, request) -> AsyncIterator[Agents]:
    kind = request.param
    if kind == "redis":
        redis = request.getfixturevalue("durable_redis")
        store = redis.url

        def fault() -> contextlib.AbstractContextManager[None]:
            return redis_down(redis)

    else:
        path = tmp_path / "runs.sqlite3"
        store = str(path)

        def fault() -> contextlib.AbstractContextManager[None]:
            return sqlite_write_lock(path)

    tools = KeyedTools(hang_first=True)
    ports = {name: free_port() for name in REPLICAS}
    metrics = {f"{name}_metrics": free_port() for name in ports}
    units = {
        name: (port, {"AIMESH_SERVICES__AGENT__METRICS_PORT": str(metrics[name + "_metrics"])})
        for name, port in ports.items()
    }
    async with agents_on(tmp_path, store, tools, units) as processes:
        yield Agents(processes, {**ports, **metrics}, tools, fault)


async def _until(check, what: str, limit_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("agents", ["redis", "sqlite"], indirect=True)
async def test_a_run_store_fault_ends_no_replica_and_is_reported(agents):
    for name in REPLICAS:
        await _until(lambda n=name: _is(agents.health(n), "SERVING"), f"{name} reports no store")
    with agents.fault():
        for name in REPLICAS:
            await _until(
                lambda n=name: _is(agents.health(n), "NOT_SERVING"),
                f"{name} did not report the store failing",
            )
            assert agents.store_state(name) == "failing"
        # A new run is refused as the store's fault, for the caller to try again.
        async with create_channel(agents.target("agent-a"), MeshSettings()) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anext(aiter(stub.Run(agent_pb2.RunRequest(question="Now?"), timeout=30)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        await asyncio.sleep(OUTAGE_S)  # longer than a lease: every renewal failed
        assert agents.alive() == {"agent-a": None, "agent-b": None}
    for name in REPLICAS:
        await _until(lambda n=name: _is(agents.health(n), "SERVING"), f"{name} did not recover")
        assert agents.store_state(name) == "ok"
    assert agents.alive() == {"agent-a": None, "agent-b": None}
    async with create_channel(agents.target("agent-b"), MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        agents.tools.hang_first = False
        events = [
            e async for e in stub.Run(agent_pb2.RunRequest(question="Copy a list?"), timeout=60)
        ]
    assert events[-1].final.state == agent_pb2.RUN_STATE_ANSWERED


async def _is(answer, expected: str) -> bool:
    return await answer == expected


@pytest.mark.parametrize("agents", ["redis", "sqlite"], indirect=True)
async def test_a_run_whose_lease_lapsed_in_a_fault_stops_and_goes_on_once(agents):
    seen: list[agent_pb2.RunResponse] = []
    async with create_channel(agents.target("agent-a"), MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        running = stub.Run(
            agent_pb2.RunRequest(question="How do I copy a nested list?"), timeout=60
        )
        async for event in running:
            seen.append(event)
            if event.HasField("tool_call"):
                break
        await asyncio.wait_for(agents.tools.started.wait(), 10)  # the run waits on the tool
        with agents.fault():
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                async for event in running:
                    seen.append(event)
            # The tool call below the stopped run was cancelled with it.
            await asyncio.wait_for(agents.tools.cancelled.wait(), 10)
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value
    assert "re-attach" in lost.value.details()
    async with create_channel(agents.target("agent-b"), MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.AttachRequest(run_id=seen[-1].run_id, after_seq=seen[-1].seq)
        rest = [event async for event in stub.Attach(request, timeout=60)]
    events = seen + rest
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    finals = [e.final for e in events if e.HasField("final")]
    assert len(finals) == 1 and finals[0].state == agent_pb2.RUN_STATE_ANSWERED
    assert any("resumed" in note for note in finals[0].notes)
    # Made again once, where the run went on, under the same idempotency key.
    assert len(agents.tools.keys) == 2 and agents.tools.keys[0] == agents.tools.keys[1]
    answer = "".join(e.answer_delta.text for e in events if e.HasField("answer_delta"))
    assert answer == "".join(ANSWER)
    assert agents.alive() == {"agent-a": None, "agent-b": None}
