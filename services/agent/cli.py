"""`aimesh ask`: one question to the agent, the answer streamed with its citations."""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator
from typing import Annotated

import grpc
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
from services.agent.run_store import open_run_store
from services.agent.settings import AgentSettings

# From the generated code, not the servicer: a command must not import the engine.
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]


def _channel() -> grpc.aio.Channel:
    settings = MeshSettings()
    target = settings.target_of(SPEC.name, SPEC.default_port)
    return create_channel(target, settings, services=[SERVICE])


async def _collect(events: AsyncIterator[agent_pb2.RunResponse], stream: bool) -> dict:
    """A run's events (from Run or Attach) as one result; the answer echoed as it comes
    when `stream`."""
    answer, citations, tools, final = "", [], {}, agent_pb2.Final()
    run_id = ""
    async for event in events:
        if not run_id and event.run_id:
            run_id = event.run_id
            if stream:
                typer.echo(f"[run {run_id}]", err=True)
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
            tools.setdefault(result.call_id, {"name": result.name}).update(
                is_error=result.is_error, summary=result.summary, ms=ms
            )
        elif kind == "citations":
            citations = list(event.citations.passage_ids)
        elif kind == "final":
            final = event.final
    return {
        "run_id": run_id,
        "state": agent_pb2.RunState.Name(final.state),
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


async def _ask(request: agent_pb2.RunRequest, stream: bool) -> dict:
    async with _channel() as channel:
        return await _collect(agent_pb2_grpc.AgentServiceStub(channel).Run(request), stream)


def ask(
    question: Annotated[str, typer.Argument(help="what to ask")],
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object at the end")] = False,
    max_iterations: Annotated[int | None, typer.Option(help="plan/act rounds, 1-25")] = None,
    seed: Annotated[int | None, typer.Option(help="makes the answer reproducible")] = None,
    timeout: Annotated[float, typer.Option(help="seconds for the whole run")] = 60.0,
    background: Annotated[
        bool,
        typer.Option(help="the run goes on if this command stops; `aimesh runs attach` it"),
    ] = False,
    session: Annotated[
        str, typer.Option(help="a conversation: the answer knows the session's earlier turns")
    ] = "",
) -> None:
    """Ask the agent: it plans, calls tools in parallel, and answers with citations."""
    # None leaves an optional field unset: the agent's default.
    options = agent_pb2.RunOptions(max_iterations=max_iterations, seed=seed, background=background)
    request = agent_pb2.RunRequest(question=question, options=options, session_id=session)
    result, trace_id = run_command("ask", lambda: _ask(request, not as_json), timeout_s=timeout)
    _print(result, trace_id, as_json)


def _print(result: dict, trace_id: str, as_json: bool) -> None:
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
        f"[{result['state']}, {result['timing'].get('total', 0):.0f} ms, "
        f"{result['iterations']} iteration(s), planner {result['planner']}, "
        f"run {result['run_id']}, trace {result['trace_id']}]",
        err=True,
    )


runs_app = typer.Typer(
    help="The agent's runs, by id: show, attach, cancel; a session's turns.", no_args_is_help=True
)
RunId = Annotated[str, typer.Argument(help="the run's id, as `aimesh ask` printed it")]


@runs_app.command()
def show(run_id: RunId) -> None:
    """Where a run stands: its state, its events so far, its question."""

    async def work() -> agent_pb2.GetRunResponse:
        async with _channel() as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            return await stub.GetRun(agent_pb2.GetRunRequest(run_id=run_id))

    got, _ = run_command("runs show", work, timeout_s=30)
    typer.echo(
        f"{got.run_id} {agent_pb2.RunState.Name(got.state)}, {got.events} events, "
        f"started {datetime.datetime.fromtimestamp(got.created_at, datetime.UTC):%Y-%m-%d %H:%M:%S}"
        f" UTC\nquestion: {got.question}"
    )


@runs_app.command()
def attach(
    run_id: RunId,
    after: Annotated[int, typer.Option(min=0, help="the last event seen; 0: all")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object at the end")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to follow the run")] = 120.0,
) -> None:
    """Follows a run from event AFTER on, to its end, as `aimesh ask` shows it."""

    async def work() -> dict:
        async with _channel() as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            events = stub.Attach(agent_pb2.AttachRequest(run_id=run_id, after_seq=after))
            return await _collect(events, not as_json)

    result, trace_id = run_command("runs attach", work, timeout_s=timeout)
    _print(result, trace_id, as_json)


@runs_app.command()
def cancel(run_id: RunId) -> None:
    """Stops a run (its tool calls and generation) from any terminal."""

    async def work() -> agent_pb2.CancelResponse:
        async with _channel() as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            return await stub.Cancel(agent_pb2.CancelRequest(run_id=run_id))

    cancelled, _ = run_command("runs cancel", work, timeout_s=30)
    typer.echo(f"{run_id} {agent_pb2.RunState.Name(cancelled.state)}")


async def session_turns(
    stub: agent_pb2_grpc.AgentServiceStub, session_id: str, page_size: int = 0
) -> AsyncIterator[agent_pb2.Turn]:
    """Every turn of a session, oldest first, a page (GetSession) at a time."""
    token = ""
    while True:
        got = await stub.GetSession(
            agent_pb2.GetSessionRequest(
                session_id=session_id, page_size=page_size, page_token=token
            ),
            timeout=30,
        )
        for turn in got.turns:
            yield turn
        token = got.next_page_token
        if not token:
            return


@runs_app.command()
def session(
    session_id: Annotated[str, typer.Argument(help="as `aimesh ask --session` named it")],
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per turn")] = False,
    timeout: Annotated[float, typer.Option(help="seconds for the whole listing")] = 120.0,
) -> None:
    """A session's turns, oldest first: each question, its answer and how its run ended."""

    async def work() -> list[agent_pb2.Turn]:
        async with _channel() as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            return [turn async for turn in session_turns(stub, session_id)]

    turns, _ = run_command("runs session", work, timeout_s=timeout)
    for turn in turns:
        if as_json:
            typer.echo(json.dumps(json_format.MessageToDict(turn)))
            continue
        at = datetime.datetime.fromtimestamp(turn.created_at, datetime.UTC)
        state = agent_pb2.RunState.Name(turn.state).removeprefix("RUN_STATE_")
        cut = " [answer cut short: `aimesh runs attach` shows it whole]"
        typer.echo(
            f"{at:%Y-%m-%d %H:%M:%S} UTC run {turn.run_id} {state}\n"
            f"  Q: {turn.question}\n  A: {turn.answer}{cut if turn.answer_truncated else ''}"
        )


@runs_app.command()
def handoffs(
    take: Annotated[
        str | None, typer.Option(help="a run id: you took it, it leaves the queue")
    ] = None,
    last: Annotated[int, typer.Option(min=1, help="how many, oldest first")] = 20,
) -> None:
    """The runs the agent handed to a person, from the run store the config names
    ([services.agent] run_store)."""
    settings = MeshSettings()
    options = AgentSettings.of(settings, SPEC.name)
    store = open_run_store(options.run_store, settings.cache_dir, options.run_retention_s)
    try:
        if take is not None:
            if not store.take_handoff(take):
                typer.echo(f"error: {take} is not in the handoff queue", err=True)
                raise typer.Exit(1)
            typer.echo(f"{take} taken")
            return
        table = Table("run", "client", "at (UTC)", "question", "why")
        for handoff in store.handoffs(last):
            at = datetime.datetime.fromtimestamp(handoff.created_at, datetime.UTC)
            table.add_row(
                handoff.run_id,
                handoff.client or "-",
                f"{at:%Y-%m-%d %H:%M:%S}",
                handoff.question[:80],
                "; ".join(handoff.notes)[:200],
            )
        Console().print(table)
    finally:
        store.close()
