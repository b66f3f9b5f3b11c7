"""The tools service over real gRPC, its built-in tools on real backends."""

from __future__ import annotations

import asyncio
import io

import grpc
import pytest
import pytest_asyncio
from google.protobuf import json_format, struct_pb2
from PIL import Image

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from aimesh.tools.v1 import tools_pb2
from mesh.breaker import State
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import field_violations
from tests.conftest import free_port

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(start_tools):
    return await start_tools()


def call(tool: str, key: str = "", **arguments) -> tools_pb2.CallToolRequest:
    struct = struct_pb2.Struct()
    struct.update(arguments)
    return tools_pb2.CallToolRequest(name=tool, arguments=struct, idempotency_key=key)


async def run(stub, request) -> tuple[list[tools_pb2.Progress], tools_pb2.CallToolResult]:
    messages = [m async for m in stub.CallTool(request)]
    *progress, last = messages
    assert last.HasField("result") and all(m.HasField("progress") for m in progress)
    return [m.progress for m in progress], last.result


def structured(result: tools_pb2.CallToolResult) -> dict:
    return json_format.MessageToDict(result.structured_content)


async def test_list_tools_describes_every_builtin_with_schemas(mesh):
    listed = await mesh.stub.ListTools(tools_pb2.ListToolsRequest())
    tools = {t.name: t for t in listed.tools}
    assert set(tools) == {"calculator", "generate_image", "knowledge_search", "python_doc"}
    assert listed.next_cursor == ""
    for tool in tools.values():
        schema = json_format.MessageToDict(tool.input_schema)
        assert schema["type"] == "object" and tool.description and tool.timeout_ms > 0
        assert json_format.MessageToDict(tool.output_schema)["type"] == "object"
    assert tools["knowledge_search"].annotations.read_only
    assert not tools["generate_image"].annotations.idempotent
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.ListTools(tools_pb2.ListToolsRequest(cursor="x9"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_calculator_results_and_errors_for_the_model(mesh):
    _, result = await run(mesh.stub, call("calculator", expression="(17*23)+4"))
    assert not result.is_error and structured(result)["value"] == 395
    assert result.content[0].text == "(17*23)+4 = 395"
    _, result = await run(mesh.stub, call("calculator", expression="1/0"))
    assert result.is_error and "division by zero" in result.content[0].text


async def test_knowledge_search_reports_progress_and_cites_passage_ids(mesh):
    progress, result = await run(
        mesh.stub, call("knowledge_search", query="deep copy a nested list", top_k=2)
    )
    assert [p.message for p in progress] == ["searching the knowledge base"]
    passages = structured(result)["passages"]
    assert passages[0]["id"] == "copy.deepcopy" and len(passages) == 2
    assert "[copy.deepcopy]" in result.content[0].text


async def test_python_doc_joins_every_part_of_one_exact_name(mesh):
    _, result = await run(mesh.stub, call("python_doc", name="json.loads"))
    assert structured(result)["passage_ids"] == ["json.loads", "json.loads#2"]
    _, missing = await run(mesh.stub, call("python_doc", name="json.dumps"))
    assert missing.is_error and "knowledge_search" in missing.content[0].text


async def test_generate_image_streams_progress_and_returns_the_png(mesh):
    progress, result = await run(mesh.stub, call("generate_image", prompt="4", seed=5))
    assert (
        progress[0].message == "image job running" and progress[-1].progress == progress[-1].total
    )
    image = result.content[1].image
    assert image.mime_type == "image/png"
    assert Image.open(io.BytesIO(image.data)).size == (8, 8)
    assert structured(result)["seeds"] == [5]
    # The diffusion service's refusal comes back for the model to read, not as an RPC error.
    _, refused = await run(mesh.stub, call("generate_image", prompt="a cat"))
    assert refused.is_error and "INVALID_ARGUMENT" in refused.content[0].text


BAD = {
    "unknown argument": (call("calculator", expression="1", precision=3), ["arguments"]),
    "missing argument": (call("knowledge_search", top_k=3), ["arguments"]),
    "wrong type": (call("knowledge_search", query=7), ["arguments.query"]),
    "out of range": (call("knowledge_search", query="x", top_k=500), ["arguments.top_k"]),
    "code for the calculator": (
        call("calculator", expression="__import__('os')"),
        ["arguments.expression"],
    ),
    "an enum it is not": (call("generate_image", model="sdxl"), ["arguments.model"]),
    "no tool named": (tools_pb2.CallToolRequest(), ["name"]),
    "a huge idempotency key": (call("calculator", "k" * 200, expression="1"), ["idempotency_key"]),
}


@pytest.mark.parametrize(("request_", "fields"), BAD.values(), ids=BAD.keys())
async def test_bad_calls_are_invalid_argument_with_schema_paths(mesh, request_, fields):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run(mesh.stub, request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(caught.value)] == fields


async def test_an_unknown_tool_is_not_found(mesh):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run(mesh.stub, call("web_search", query="x"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_an_idempotency_key_replays_the_first_result(mesh):
    first = await run(mesh.stub, call("generate_image", "draw-4-once", prompt="4"))
    progress, again = await run(mesh.stub, call("generate_image", "draw-4-once", prompt="4"))
    assert progress == [] and again == first[1]  # same job, same seed: it did not run twice
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run(mesh.stub, call("generate_image", "draw-4-once", prompt="5"))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    concurrent = await asyncio.gather(
        *(run(mesh.stub, call("generate_image", "together", prompt="2")) for _ in range(3))
    )
    assert len({structured(result)["job_id"] for _, result in concurrent}) == 1


async def busy_diffusion(target: str):
    """A long digits job holding the diffusion service's one slot."""
    channel = create_channel(target, MeshSettings())
    stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
    job = stub.Generate(
        diffusion_pb2.GenerateRequest(
            model="digits", num_images=100, steps=200, sampler=diffusion_pb2.SAMPLER_DDPM
        )
    )
    await anext(aiter(job))
    return channel, job


@pytest.mark.parametrize(
    ("limits", "says"),
    [
        ({"idle_timeout_s": {"generate_image": 0.5}}, "sent no progress for 0.5 s"),
        ({"timeout_s": {"generate_image": 0.5}}, "ran past its 0.5 s limit"),
        ({"max_call_s": 0.5}, "ran past its 0.5 s limit"),
    ],
    ids=["idle", "own limit", "absolute cap"],
)
async def test_a_stuck_tool_is_stopped_by_its_limits(start_tools, limits, says):
    mesh = await start_tools(**limits)
    channel, job = await busy_diffusion(mesh.diffusion)
    try:
        _, result = await run(mesh.stub, call("generate_image", prompt="1"))
        assert result.is_error and says in result.content[0].text
    finally:
        job.cancel()
        await channel.close()


async def test_the_backend_breaker_counts_transport_failures_not_tool_errors(start_tools):
    dead = f"127.0.0.1:{free_port()}"
    mesh = await start_tools(dependencies={"retrieval": dead})
    for _ in range(12):
        _, result = await run(mesh.stub, call("python_doc", name="json.loads"))
        assert result.is_error and "UNAVAILABLE" in result.content[0].text
    assert mesh.tools.channels.breakers[dead].state is State.OPEN

    healthy = await start_tools()
    for _ in range(12):
        _, result = await run(healthy.stub, call("python_doc", name="no.such_name"))
        assert result.is_error
    (breaker,) = [b for t, b in healthy.tools.channels.breakers.items() if t != dead]
    assert breaker.state is State.CLOSED
