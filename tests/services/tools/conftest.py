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
from services.tools.servicer import SERVICE
from tests.conftest import free_port
from tests.harness import InProcess
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


async def fill_knowledge(target: str, settings: MeshSettings | None = None) -> None:
    async with create_channel(target, settings or MeshSettings()) as channel:
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


async def serve_tools(
    services: InProcess, dependencies: dict[str, str], **tools_settings: object
) -> ToolsMesh:
    """A tools server in `services` dialling `dependencies`, with [services.tools] settings."""
    settings = MeshSettings(
        services={"tools": ServiceSettings(dependencies=dependencies, **tools_settings)},
    )
    tools = await services.start("tools", settings)
    stub = tools_pb2_grpc.ToolsServiceStub(services.channel(tools.target, SERVICE))
    return ToolsMesh(stub, tools.server, dependencies["diffusion"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def start_tools(tmp_path_factory) -> AsyncIterator[StartTools]:
    async with InProcess() as services:
        rerank = await services.start("rerank")
        _, retrieval = await start_retrieval(
            tmp_path_factory.mktemp("tools-kb"), rerank=rerank.target, services=services
        )
        await fill_knowledge(f"127.0.0.1:{retrieval.port}")
        diffusion = await services.start(
            "diffusion",
            MeshSettings(services={"diffusion": {"device": "cpu", "models": ["digits"]}}),
        )

        async def start(
            dependencies: dict[str, str] | None = None, **tools_settings: object
        ) -> ToolsMesh:
            targets = {
                "retrieval": f"127.0.0.1:{retrieval.port}",
                "diffusion": diffusion.target,
                **(dependencies or {}),
            }
            return await serve_tools(services, targets, **tools_settings)

        yield start


StartFake = Callable[[Callable[[Any, grpc.aio.Server], None], Any], Awaitable[str]]


@pytest_asyncio.fixture
async def start_fake() -> AsyncIterator[StartFake]:
    """Serves a fake servicer, e.g. start_fake(add_..._to_server, FakeRetrieval()), on a
    MeshServer as the echo service's spec declares it (no dependencies, nothing exempt
    from admission); returns its target."""
    async with InProcess() as services:

        async def start(register: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> str:
            async def serve(server: MeshServer) -> Any:
                register(servicer, server.grpc_server)
                return servicer

            return (await services.start("echo", setup=serve)).target

        yield start


@pytest_asyncio.fixture
async def bare_tools() -> AsyncIterator[StartTools]:
    """Starts tools servers whose dependencies are closed ports unless given."""
    async with InProcess() as services:

        async def start(
            dependencies: dict[str, str] | None = None, **tools_settings: object
        ) -> ToolsMesh:
            dead = f"127.0.0.1:{free_port()}"
            targets = {"retrieval": dead, "diffusion": dead, **(dependencies or {})}
            return await serve_tools(services, targets, **tools_settings)

        yield start
