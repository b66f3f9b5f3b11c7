"""The generation router outlives its registry's faults, on real processes: the
tokenizer, prefill and decode serving the embedded SmolLM2, and routers following a
registry file or a registry in a real redis-server. A registered model ("chat", on the
router's own workers) is generated from in a steady stream while the registry file gets
a field the router does not know, is cut short, while the registry's Redis is killed -9
for seconds: no request fails, no router exits, each says the registry is failing
(`generation.registry` NOT_SERVING, aimesh_store_state) and follows it again once it reads
well. A router started on an invalid registry comes up serving its own model.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc
from loadtest.chaos_mesh import RedisProcess
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.deployments import FileStore, RedisStore, Version, activate, register
from mesh.health import probe
from services.generation.servicer import GENERATION
from services.llm.artifacts import DEFAULT_NAME
from tests.conftest import free_port, subprocess_env
from tests.harness import ServiceProcesses
from tests.services.llm.conftest import MAX_BATCH, MAX_SEQ_LEN, stopping

pytestmark = pytest.mark.system

MODEL = "chat"
HEALTH_NAME = "generation.registry"
OUTAGE_S = 5.0


@dataclass
class Routers:
    root: Path
    ports: dict[str, int]
    processes: ServiceProcesses
    redis: RedisProcess
    registry_file: Path
    env: dict[str, dict[str, str]] = field(default_factory=dict)

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def returncode(self, name: str) -> int | None:
        return self.processes.children[name].process.returncode

    async def health(self, name: str) -> str:
        return await probe(self.target(name), HEALTH_NAME, timeout_s=5)

    def store_states(self, name: str) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.ports[name + '_metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        found = re.findall(
            r'^aimesh_store_state\{state="(\w+)",store="registry"\} (\S+)$', text, re.MULTILINE
        )
        return {state: float(value) for state, value in found}

    async def start(self, name: str) -> None:
        await self.processes.start(name, "generation", self.ports[name], **self.env[name])


def _versions(store) -> None:
    """Two versions of "chat" on the router's own workers; v1 active."""
    for name in ("v1", "v2"):
        store.update(lambda s, n=name: register(s, MODEL, Version(name=n, engine="torch"), "t"))
    store.update(lambda s: activate(s, MODEL, "v1", "t"))


@pytest.fixture(scope="module")
def routers(tmp_path_factory, model_dir) -> Iterator[Routers]:
    root = tmp_path_factory.mktemp("registry-faults")
    names = ["tokenizer", "prefill", "decode", "router-file", "router-redis", "router-late"]
    ports = {name: free_port() for name in names}
    ports |= {f"{name}_metrics": free_port() for name in names if name.startswith("router")}
    config = root / "aimesh.toml"
    config.write_text(
        f"[engines.llm]\nmax_seq_len = {MAX_SEQ_LEN}\nmax_batch_size = {MAX_BATCH}\n"
        'engine = "torch"\nprefill_engine = "torch"\ndtype = "float32"\n'
        f"[services.tokenizer]\nport = {ports['tokenizer']}\n"
        f"[services.prefill]\nport = {ports['prefill']}\n"
        f'[services.decode]\nprefill = ["127.0.0.1:{ports["prefill"]}"]\n'
        f'[services.generation]\nprefill = ["127.0.0.1:{ports["prefill"]}"]\n'
        f'decode = ["127.0.0.1:{ports["decode"]}"]\nregistry_poll_s = 0.2\n'
        f'[services.generation.dependencies]\ntokenizer = "127.0.0.1:{ports["tokenizer"]}"\n'
    )
    redis = RedisProcess(root / "redis")
    redis.start()
    registry_file = root / "deployments.json"
    _versions(FileStore(registry_file))
    redis_store = RedisStore(redis.url)
    _versions(redis_store)
    redis_store.close()
    processes = ServiceProcesses(
        root, subprocess_env(AIMESH_CONFIG=str(config), OTEL_TRACES_EXPORTER="none")
    )
    mesh = Routers(root, ports, processes, redis, registry_file)
    for name, registry in (
        ("router-file", str(registry_file)),
        ("router-redis", redis.url),
        ("router-late", str(root / "late.json")),
    ):
        mesh.env[name] = {
            "AIMESH_DEPLOYMENTS": registry,
            "AIMESH_SERVICES__GENERATION__METRICS_PORT": str(ports[f"{name}_metrics"]),
        }
    try:
        processes.start_all(
            [
                ("tokenizer", "tokenizer", ports["tokenizer"], {}),
                ("prefill", "prefill", ports["prefill"], {}),
                ("decode", "decode", ports["decode"], {}),
                ("router-file", "generation", ports["router-file"], mesh.env["router-file"]),
                ("router-redis", "generation", ports["router-redis"], mesh.env["router-redis"]),
            ]
        )
        yield mesh
    finally:
        processes.close()
        redis.kill()


@dataclass
class Stream:
    """Requests for "chat" sent back to back by two callers: each one's version or error."""

    served: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, target: str) -> None:
        async with create_channel(target, MeshSettings(), services=[GENERATION]) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            await asyncio.gather(self._caller(stub), self._caller(stub))

    async def _caller(self, stub) -> None:
        while not self.stop.is_set():
            try:
                self.served.append((await _generate(stub)).model_version)
            except grpc.aio.AioRpcError as error:
                self.errors.append(f"{error.code().name}: {error.details()}")

    async def until(self, count: int, version: str = "", limit_s: float = 120) -> None:
        """Until `count` more requests are served (by `version`, when given)."""
        wanted = self._count(version) + count
        deadline = time.monotonic() + limit_s
        while self._count(version) < wanted:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"fewer than {count} served in {limit_s} s"
            await asyncio.sleep(0.05)

    def _count(self, version: str) -> int:
        return sum(not version or v == version for v in self.served)


async def _generate(stub, model: str = MODEL) -> generation_pb2.GenerationComplete:
    async for message in stub.Generate(
        generation_pb2.GenerateRequest(prompt="Hello", model=model, stopping=stopping(2)),
        timeout=60,
    ):
        if message.HasField("complete"):
            return message.complete
    raise AssertionError("the stream ended without GenerationComplete")


async def _until_health(routers: Routers, name: str, status: str, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while (now := await routers.health(name)) != status:
        assert routers.returncode(name) is None, f"{name} exited"
        assert time.monotonic() < deadline, f"{name} registry health {now}, not {status}"
        await asyncio.sleep(0.1)


@asynccontextmanager
async def steady_stream(routers: Routers, name: str) -> AsyncIterator[Stream]:
    """A Stream of requests to router `name` for the block's length, stopped after it."""
    stream = Stream()
    load = asyncio.create_task(stream.run(routers.target(name)))
    try:
        yield stream
    finally:
        stream.stop.set()
        await load


async def test_a_spoiled_registry_file_fails_no_request_and_ends_no_router(routers):
    name = "router-file"
    async with steady_stream(routers, name) as stream:
        await stream.until(3, "v1")
        good = routers.registry_file.read_text()
        for spoiled in (good.replace('"revision"', '"colour": "red", "revision"', 1), good[:64]):
            routers.registry_file.write_text(spoiled)
            await _until_health(routers, name, "NOT_SERVING")
            assert routers.store_states(name)["invalid"] == 1
            await stream.until(5, "v1")  # still served, by the last valid table
        routers.registry_file.write_text(good)  # put right, then changed
        FileStore(routers.registry_file).update(lambda s: activate(s, MODEL, "v2", "t"))
        await _until_health(routers, name, "SERVING")
        await stream.until(3, "v2")
    assert stream.errors == []
    assert routers.returncode(name) is None
    assert routers.store_states(name)["ok"] == 1


async def test_the_registry_redis_killed_fails_no_request_and_ends_no_router(routers):
    name = "router-redis"
    async with steady_stream(routers, name) as stream:
        await stream.until(3, "v1")
        routers.redis.kill()
        try:
            await _until_health(routers, name, "NOT_SERVING")
            assert routers.store_states(name)["unreachable"] == 1
            ends = time.monotonic() + OUTAGE_S
            while time.monotonic() < ends:
                await stream.until(1, "v1")
        finally:
            routers.redis.start()
        await _until_health(routers, name, "SERVING")
        store = RedisStore(routers.redis.url)
        store.update(lambda s: activate(s, MODEL, "v2", "t"))  # the registry kept its data
        store.close()
        await stream.until(3, "v2")
    assert stream.errors == []
    assert routers.returncode(name) is None


async def test_a_router_started_on_an_invalid_registry_serves_its_own_model(routers):
    name = "router-late"
    late = routers.root / "late.json"
    late.write_text('{"revision": 2, "deployments": {"chat": {"model": "chat", "active": "x"}}}')
    await routers.start(name)  # ready: it did not wait for a registry it cannot read
    assert await routers.health(name) == "NOT_SERVING"
    async with create_channel(routers.target(name), MeshSettings(), services=[GENERATION]) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        own = await _generate(stub, model="")
        assert (own.model, own.model_version) == (DEFAULT_NAME, "")
        late.unlink()
        _versions(FileStore(late))  # an operator writes a valid registry
        await _until_health(routers, name, "SERVING")
        deadline = time.monotonic() + 30
        while True:
            try:
                assert (await _generate(stub)).model_version == "v1"
                break
            except grpc.aio.AioRpcError as error:  # "chat" unknown until the look applies it
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
                assert time.monotonic() < deadline, "the fixed registry was not followed"
                await asyncio.sleep(0.2)
    assert routers.returncode(name) is None
