"""A tools server wired to real retrieval (a small knowledge collection, reranked by a
real rerank server) and diffusion servers, all on 127.0.0.1; and a bare one, whose
dependencies are closed ports or small fakes, for tests that need no model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest_asyncio
from google.protobuf import struct_pb2

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from aimesh.tools.v1 import tools_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings, ServiceSettings
from mesh.server import MeshServer
from services.diffusion.servicer import setup as diffusion_setup
from services.rerank.servicer import setup as rerank_setup
from services.tools.servicer import SERVICE
from services.tools.servicer import setup as tools_setup
from tests.conftest import free_port
from tests.services.retrieval.conftest import start_retrieval

PASSAGES = [
    ("copy.deepcopy", "copy.deepcopy(x, memo=None)\n\nDeep copy operation on arbitrary Python "
     "objects: nested lists and dicts are copied recursively.", 1),
    ("json.loads", "json.loads(s)\n\nDeserialize s (a str containing a JSON document) to a "
     "Python object.", 1),
    ("json.loads#2", "json.loads (continued)\n\nIf s is a bytes instance it is decoded first.", 2),
    ("shutil.rmtree", "shutil.rmtree(path)\n\nRecursively delete a directory tree.", 1),
]  # fmt: skip


@dataclass
class ToolsMesh:
    stub: tools_pb2_grpc.ToolsServiceStub
    tools: MeshServer
    diffusion: str


StartTools = Callable[..., Awaitable[ToolsMesh]]


async def fill_knowledge(target: str) -> None:
    async with create_channel(target, MeshSettings()) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        await stub.CreateCollection(
            retrieval_pb2.CreateCollectionRequest(collection="knowledge", sparse_enabled=True)
        )

        async def documents():
            for name, text, part in PASSAGES:
                payload = struct_pb2.Struct()
                payload.update({"title": name.partition("#")[0], "source": "stdlib", "part": part})
                yield retrieval_pb2.UpsertRequest(
                    collection="knowledge",
                    documents=[retrieval_pb2.Document(id=name, text=text, payload=payload)],
                )

        await stub.Upsert(documents())


def tools_server(dependencies: dict[str, str], **tools_settings: object) -> MeshServer:
    """A tools server (not set up) dialling `dependencies`, with [services.tools] settings."""
    settings = MeshSettings(
        services={"tools": ServiceSettings(dependencies=dependencies, **tools_settings)},
    )
    return MeshServer.for_service("tools", settings, port=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def start_tools(tmp_path_factory) -> AsyncIterator[StartTools]:
    rerank = MeshServer.for_service("rerank", MeshSettings(), port=0)
    await rerank_setup(rerank)
    await rerank.start()
    embedder, retrieval = await start_retrieval(
        tmp_path_factory.mktemp("tools-kb"), rerank=f"127.0.0.1:{rerank.port}"
    )
    await fill_knowledge(f"127.0.0.1:{retrieval.port}")
    diffusion = MeshServer.for_service(
        "diffusion",
        MeshSettings(services={"diffusion": {"device": "cpu", "models": ["digits"]}}),
        port=0,
    )
    await diffusion_setup(diffusion)
    await diffusion.start()
    servers = [rerank, embedder, retrieval, diffusion]
    channels = []

    async def start(
        dependencies: dict[str, str] | None = None, **tools_settings: object
    ) -> ToolsMesh:
        targets = {
            "retrieval": f"127.0.0.1:{retrieval.port}",
            "diffusion": f"127.0.0.1:{diffusion.port}",
            **(dependencies or {}),
        }
        tools = tools_server(targets, **tools_settings)
        await tools_setup(tools)
        await tools.start()
        servers.append(tools)
        channel = create_channel(f"127.0.0.1:{tools.port}", MeshSettings(), services=[SERVICE])
        channels.append(channel)
        return ToolsMesh(tools_pb2_grpc.ToolsServiceStub(channel), tools, targets["diffusion"])

    yield start
    for channel in channels:
        await channel.close()
    for server in reversed(servers):
        await server.drain(0)


StartFake = Callable[[Callable[[Any, grpc.aio.Server], None], Any], Awaitable[str]]


@pytest_asyncio.fixture
async def start_fake() -> AsyncIterator[StartFake]:
    """Starts a plain grpc server for a fake servicer, e.g. start_fake(add_..._to_server,
    FakeRetrieval()); returns its target."""
    servers: list[grpc.aio.Server] = []

    async def start(register: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> str:
        server = grpc.aio.server()
        register(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


@pytest_asyncio.fixture
async def bare_tools() -> AsyncIterator[StartTools]:
    """Starts tools servers whose dependencies are closed ports unless given."""
    servers: list[MeshServer] = []
    channels = []

    async def start(
        dependencies: dict[str, str] | None = None, **tools_settings: object
    ) -> ToolsMesh:
        dead = f"127.0.0.1:{free_port()}"
        targets = {"retrieval": dead, "diffusion": dead, **(dependencies or {})}
        tools = tools_server(targets, **tools_settings)
        await tools_setup(tools)
        await tools.start()
        servers.append(tools)
        channel = create_channel(f"127.0.0.1:{tools.port}", MeshSettings(), services=[SERVICE])
        channels.append(channel)
        return ToolsMesh(tools_pb2_grpc.ToolsServiceStub(channel), tools, targets["diffusion"])

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.drain(0)
