"""The agent against the whole mesh, every service its own process, over loopback gRPC."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from google.protobuf import json_format

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings, ServiceSettings
from mesh.errors import field_violations
from tests.conftest import VENV_BIN, eventually, free_port
from tests.harness import InProcess

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="package")]

FAST = agent_pb2.RunOptions(max_new_tokens=24, seed=1)


async def run(target: str, question: str, options=FAST, deadline_s: float = 120):
    async with create_channel(target, MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.RunRequest(question=question, options=options)
        return [event async for event in stub.Run(request, timeout=deadline_s)]


def of(events, kind: str) -> list:
    return [getattr(e, kind) for e in events if e.WhichOneof("event") == kind]


async def test_a_knowledge_question_is_answered_with_citations(mesh):
    events = await run(mesh.target("agent"), "How do I deep copy a nested list?")
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "plan" and kinds[-1] == "final"
    assert kinds.index("tool_call") < kinds.index("tool_result") < kinds.index("answer_delta")
    (plan,) = of(events, "plan")
    assert plan.steps
    (call,), (result,) = of(events, "tool_call"), of(events, "tool_result")
    assert call.name == "knowledge_search" and result.call_id == call.call_id
    assert not result.is_error
    assert "".join(d.text for d in of(events, "answer_delta")).strip()
    (citations,) = of(events, "citations")
    assert "copy.deepcopy" in citations.passage_ids
    (final,) = of(events, "final")
    assert final.iterations == 1 and final.usage.completion_tokens > 0
    hops = {(s.name, s.service) for s in final.timing.stages}
    assert {("plan", "agent"), ("knowledge_search", "tools"), ("answer", "generation")} <= hops
    assert len(final.trace_id) == 32
    # The model picked the tool, or the rules did and a note says why.
    assert final.planner == agent_pb2.PLANNER_LLM or any("model" in n for n in final.notes)


async def test_the_model_plans_with_a_tool_call_held_to_the_tools_schema(mesh):
    events = await run(mesh.target("agent"), "What does json.loads return?")
    plan = of(events, "plan")[0]
    assert plan.planner == agent_pb2.PLANNER_LLM
    call = of(events, "tool_call")[0]
    assert (call.name, json_format.MessageToDict(call.arguments)) == (
        "python_doc",
        {"name": "json.loads"},
    )
    assert of(events, "final")[0].planner == agent_pb2.PLANNER_LLM


async def test_independent_tools_run_in_one_iteration(mesh):
    started = time.monotonic()
    events = await run(mesh.target("agent"), "What is 6*7, and what does json.loads do?")
    calls = {c.name: c for c in of(events, "tool_call")}
    assert set(calls) == {"calculator", "python_doc"}
    results = {r.name: r for r in of(events, "tool_result")}
    assert json_format.MessageToDict(results["calculator"].structured)["value"] == 42
    assert of(events, "final")[0].iterations == 1
    assert time.monotonic() - started < 120


async def test_a_failed_lookup_is_followed_by_a_search_within_max_iterations(mesh):
    question = "What does json.dumps do?"  # not in this test's small knowledge base
    events = await run(mesh.target("agent"), question)
    assert [c.name for c in of(events, "tool_call")] == ["python_doc", "knowledge_search"]
    assert of(events, "final")[0].iterations == 2
    capped = await run(
        mesh.target("agent"), question, agent_pb2.RunOptions(max_iterations=1, max_new_tokens=8)
    )
    final = of(capped, "final")[0]
    assert final.iterations == 1 and any("max_iterations" in n for n in final.notes)


async def test_a_stuck_tool_costs_evidence_not_the_answer(mesh):
    """The image tool waits behind a long diffusion job; a 3 s run still answers in time."""
    async with create_channel(mesh.target("diffusion"), MeshSettings()) as channel:
        busy = diffusion_pb2_grpc.DiffusionServiceStub(channel).Generate(
            diffusion_pb2.GenerateRequest(
                model="digits", num_images=100, steps=200, sampler=diffusion_pb2.SAMPLER_DDPM
            )
        )
        await anext(aiter(busy))
        try:
            started = time.monotonic()
            events = await run(mesh.target("agent"), "Draw the digit 7", deadline_s=3)
            elapsed = time.monotonic() - started
        finally:
            busy.cancel()
    (result,) = of(events, "tool_result")
    assert result.name == "generate_image" and result.is_error
    final = of(events, "final")[0]
    assert elapsed < 3 and any("generate_image" in note for note in final.notes)
    assert "".join(d.text for d in of(events, "answer_delta")).strip()


async def test_without_a_language_model_the_agent_answers_from_the_evidence(mesh, tmp_path):
    dependencies = {"tools": mesh.target("tools"), "generation": f"127.0.0.1:{free_port()}"}
    agent = ServiceSettings(dependencies=dependencies, run_store=str(tmp_path / "runs.db"))
    settings = MeshSettings(services={"agent": agent})
    async with InProcess() as services:
        agent = await services.start("agent", settings)
        events = await run(agent.target, "What is 2^10?")
    answer = "".join(d.text for d in of(events, "answer_delta"))
    assert "1024" in answer
    final = of(events, "final")[0]
    assert final.planner == agent_pb2.PLANNER_FALLBACK
    assert any("planning model failed" in n for n in final.notes)
    assert any("language model failed" in n for n in final.notes)


# check_request's table runs as unit calls (tests/services/agent/test_planner_bounds.py);
# here, one of its refusals and the one that needs the tools service's ListTools, each
# through the whole mesh and its error table.
BAD = {
    "empty question": (agent_pb2.RunRequest(question="  "), "question"),
    "an unknown tool": (
        agent_pb2.RunRequest(question="hi", options=agent_pb2.RunOptions(allowed_tools=["web"])),
        "options.allowed_tools",
    ),
}


@pytest.mark.parametrize(("request_", "field"), BAD.values(), ids=BAD.keys())
async def test_bad_runs_are_invalid_argument(mesh, request_, field):
    async with create_channel(mesh.target("agent"), MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Run(request_, timeout=30):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(caught.value)] == [field]


async def test_aimesh_ask_prints_the_answer_as_json(mesh):
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "ask", "--json", "What is (17*23)+4?",
        env=mesh.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    result = json.loads(out)
    assert {"answer", "citations", "tools", "timing", "trace_id"} <= set(result)
    assert result["tools"][0]["name"] == "calculator" and not result["tools"][0]["is_error"]
    assert result["answer"].strip() and len(result["trace_id"]) == 32


async def aimesh(mesh, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), *args,
        env=mesh.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_a_run_is_shown_attached_and_cancelled_by_its_id(mesh):
    asked = json.loads(await aimesh(mesh, "ask", "--json", "--background", "What is 6*7?"))
    run_id = asked["run_id"]
    assert asked["state"] == "RUN_STATE_ANSWERED"
    assert f"{run_id} RUN_STATE_ANSWERED" in await aimesh(mesh, "runs", "show", run_id)
    attached = json.loads(await aimesh(mesh, "runs", "attach", run_id, "--json"))
    assert (attached["answer"], attached["tools"]) == (asked["answer"], asked["tools"])
    # An ended run stays as it ended.
    assert f"{run_id} RUN_STATE_ANSWERED" in await aimesh(mesh, "runs", "cancel", run_id)


def spans_by_trace(log: str) -> dict[str, set[str]]:
    """trace id -> the services that sent spans of it, from the collector's debug log."""
    traces: dict[str, set[str]] = {}
    service = ""
    for line in log.splitlines():
        if "-> service.name: Str(" in line:
            service = line.split("Str(", 1)[1].rstrip(")")
        elif line.strip().startswith("Trace ID"):
            traces.setdefault(line.split(":", 1)[1].strip(), set()).add(service)
    return traces


async def test_one_ask_is_one_trace_across_every_service_it_touched(mesh):
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "ask", "--json", "How do I deep copy a nested list?",
        env=mesh.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    trace_id = json.loads(out)["trace_id"]
    expected = {
        f"aimesh-{name}"
        for name in ("agent", "tools", "retrieval", "embedder", "rerank", "generation",
                     "tokenizer", "prefill", "decode")
    }  # fmt: skip
    seen: set[str] = set()

    def complete() -> bool:
        seen.clear()
        seen.update(spans_by_trace(mesh.spans.read_text()).get(trace_id, set()))
        return expected <= seen

    try:
        await eventually(complete, timeout_s=30, interval_s=0.5)
    except AssertionError:
        raise AssertionError(f"trace {trace_id} has spans from {sorted(seen)} only") from None
