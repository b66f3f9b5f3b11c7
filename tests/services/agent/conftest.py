"""The agent with fakes for its tools and model on loopback gRPC, reached through the
mesh's own channels: what the agent's service tests share."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest_asyncio
from google.protobuf import json_format, struct_pb2

from aimesh.agent.v1 import agent_pb2
from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc
from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh.config import MeshSettings, ServiceSettings
from mesh.server import MeshServer
from services.agent import servicer
from services.agent.servicer import AgentServicer
from services.agent.settings import AgentSettings
from services.tools.builtin import BUILTIN
from tests.harness import InProcess

Outcome = Callable[[grpc.aio.ServicerContext], AsyncIterator[tools_pb2.CallToolResponse]]


def result(text: str, structured: dict | None = None) -> Outcome:
    async def outcome(context):
        content = struct_pb2.Struct()
        json_format.ParseDict(structured or {}, content)
        yield tools_pb2.CallToolResponse(
            result=tools_pb2.CallToolResult(
                content=[tools_pb2.Content(text=text)], structured_content=content
            )
        )

    return outcome


async def no_result(context):
    yield tools_pb2.CallToolResponse(progress=tools_pb2.Progress(progress=0.5))


async def failure(context):
    await context.abort(grpc.StatusCode.INTERNAL, "the tool broke")
    yield  # pragma: no cover


class FakeTools(tools_pb2_grpc.ToolsServiceServicer):
    """Each tool does what its outcome says; "hang" runs until cancelled."""

    def __init__(self, outcomes: dict[str, Outcome | str], schemas: dict | None = None) -> None:
        self.outcomes = outcomes
        self.schemas = {t.name: t.input_schema for t in BUILTIN} if schemas is None else schemas
        self.calls: list[str] = []
        self.clients: list[list[str]] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def ListTools(self, request, context):
        listed = tools_pb2.ListToolsResponse()
        for name in sorted(self.outcomes):
            tool = listed.tools.add(name=name, description=name)
            json_format.ParseDict(self.schemas.get(name, {}), tool.input_schema)
        return listed

    async def CallTool(self, request, context):
        self.calls.append(request.name)
        metadata = context.invocation_metadata() or ()
        self.clients.append([value for key, value in metadata if key == "x-aimesh-client"])
        outcome = self.outcomes[request.name]
        if outcome == "hang":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        async for message in outcome(context):
            yield message


# A plan as the fake model makes it: its calls, (tool, arguments) each; [] answers.
Plan = list[tuple[str, dict]]


class FakeGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """Plans `plans` in turn, one per planning request (a request with tools), then
    answers instead of calling; fails every plan when `plans` is None. Answers `answer`
    (or fails, when None)."""

    def __init__(self, plans: list[Plan] | None = None, answer: str | None = "An answer.") -> None:
        self.plans = plans
        self.answer = answer
        self.answer_prompts: list[list[dict[str, str]]] = []
        self.plan_requests: list[generation_pb2.ChatRequest] = []
        self.models: list[tuple[str, str]] = []  # (plan or answer, ChatRequest.model)

    async def Chat(self, request, context):
        planning = bool(request.tools)
        self.models.append(("plan" if planning else "answer", request.model))
        if planning:
            self.plan_requests.append(request)
            if self.plans is None:
                await context.abort(grpc.StatusCode.INTERNAL, "the model broke")
            calls = self.plans.pop(0) if self.plans else []
            made = [
                common_pb2.ToolCall(id=f"call_{k}", name=name, arguments=json.dumps(arguments))
                for k, (name, arguments) in enumerate(calls)
            ]
            if not made:
                yield generation_pb2.ChatResponse(chunk=generation_pb2.GenerationChunk(text="Hi"))
            complete = generation_pb2.GenerationComplete(tool_calls=made)
            yield generation_pb2.ChatResponse(complete=complete)
            return
        self.answer_prompts.append(
            [{"role": m.role, "content": m.content} for m in request.messages]
        )
        if self.answer is None:
            await context.abort(grpc.StatusCode.INTERNAL, "the model broke")
        yield generation_pb2.ChatResponse(chunk=generation_pb2.GenerationChunk(text=self.answer))
        yield generation_pb2.ChatResponse(complete=generation_pb2.GenerationComplete())


StartAgent = Callable[..., Awaitable[AgentServicer]]


@pytest_asyncio.fixture
async def start_agent(tmp_path) -> AsyncIterator[StartAgent]:
    """An AgentServicer whose tools and generation are the given fakes on loopback, dialled
    as its declared dependencies (a caller's override, as a proxy on an edge would be)."""
    servers: list[grpc.aio.Server] = []

    async def serve(register: Callable, servicer: object) -> str:
        server = grpc.aio.server()
        register(servicer, server)
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
        return target

    async with InProcess() as services:

        async def start(
            tools: FakeTools,
            generation: FakeGeneration,
            tools_target: str | None = None,
            **options: object,
        ) -> AgentServicer:
            """`options`: AgentSettings fields; every agent of a test shares one run store."""

            async def agent_servicer(server: MeshServer) -> AgentServicer:
                settings = AgentSettings(run_store=str(tmp_path / "runs.sqlite3"), **options)
                return servicer.serve_agent(server, settings)

            dependencies = {
                "tools": tools_target
                or await serve(tools_pb2_grpc.add_ToolsServiceServicer_to_server, tools),
                "generation": await serve(
                    generation_pb2_grpc.add_GenerationServiceServicer_to_server, generation
                ),
            }
            mesh_settings = MeshSettings(
                services={"agent": ServiceSettings(dependencies=dependencies)}
            )
            served = await services.start("agent", mesh_settings, setup=agent_servicer)
            return served.servicer

        yield start
    for server in servers:
        await server.stop(0)


async def run_all(agent: AgentServicer, question: str, context=None, **fields: object) -> list:
    request = agent_pb2.RunRequest(question=question, options=agent_pb2.RunOptions(**fields))
    return [event async for event in agent.Run(request, context)]


def final(events: list) -> agent_pb2.Final:
    assert events[-1].HasField("final")
    return events[-1].final


def pending_tool_calls() -> list[asyncio.Task]:
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and task.get_coro().__qualname__ == "Loop._call"
    ]
