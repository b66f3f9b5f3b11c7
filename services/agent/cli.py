"""`aimesh ask`: one question to the agent, the answer streamed with its citations."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from google.protobuf import json_format
from rich.console import Console
from rich.table import Table

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from mesh.client import create_channel
from mesh.commands import run_command
from mesh.config import MeshSettings
from mesh.timing import timing_ms
from services.agent import SPEC

# From the generated code, not the servicer: a command must not import the engine.
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]


async def _ask(request: agent_pb2.RunRequest, stream: bool) -> dict:
    settings = MeshSettings()
    target = settings.target_of(SPEC.name, SPEC.default_port)
    answer, citations, tools, final = "", [], {}, agent_pb2.Final()
    async with create_channel(target, settings, services=[SERVICE]) as channel:
        async for event in agent_pb2_grpc.AgentServiceStub(channel).Run(request):
            kind = event.WhichOneof("event")
            if kind == "answer_delta":
                answer += event.answer_delta.text
                if stream:
                    typer.echo(event.answer_delta.text, nl=False)
            elif kind == "tool_call":
                call = event.tool_call
                arguments = json_format.MessageToDict(call.arguments)
                tools[call.call_id] = {"name": call.name, "arguments": arguments}
            elif kind == "tool_result":
                result = event.tool_result
                ms = round(result.duration_ns / 1e6, 1)
                tools[result.call_id].update(
                    is_error=result.is_error, summary=result.summary, ms=ms
                )
            elif kind == "citations":
                citations = list(event.citations.passage_ids)
            elif kind == "final":
                final = event.final
    return {
        "answer": answer,
        "citations": citations,
        "tools": list(tools.values()),
        "timing": timing_ms(final.timing),
        "hops": [
            {"hop": s.name, "service": s.service, "ms": round(s.duration_ns / 1e6, 1)}
            for s in final.timing.stages
        ],
        "iterations": final.iterations,
        "planner": agent_pb2.Planner.Name(final.planner),
        "notes": list(final.notes),
        "trace_id": final.trace_id,
    }


def ask(
    question: Annotated[str, typer.Argument(help="what to ask")],
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object at the end")] = False,
    max_iterations: Annotated[int | None, typer.Option(help="plan/act rounds, 1-25")] = None,
    seed: Annotated[int | None, typer.Option(help="makes the answer reproducible")] = None,
    timeout: Annotated[float, typer.Option(help="seconds for the whole run")] = 60.0,
) -> None:
    """Ask the agent: it plans, calls tools in parallel, and answers with citations."""
    # None leaves an optional field unset: the agent's default.
    options = agent_pb2.RunOptions(max_iterations=max_iterations, seed=seed)
    request = agent_pb2.RunRequest(question=question, options=options)
    result, trace_id = run_command("ask", lambda: _ask(request, not as_json), timeout_s=timeout)
    result["trace_id"] = result["trace_id"] or trace_id
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo()
    if result["citations"]:
        typer.echo("sources: " + ", ".join(result["citations"]))
    table = Table("hop", "service", "ms", title=f"trace {result['trace_id']}")
    for hop in result["hops"]:
        table.add_row(hop["hop"], hop["service"], f"{hop['ms']:.1f}")
    Console(stderr=True).print(table)
    for note in result["notes"]:
        typer.echo(f"  note: {note}", err=True)
    typer.echo(
        f"[{result['timing'].get('total', 0):.0f} ms, {result['iterations']} iteration(s), "
        f"planner {result['planner']}, trace {result['trace_id']}]",
        err=True,
    )
