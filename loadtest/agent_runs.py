"""Agent runs under random kills: how many are lost, how long a client waits for a resume,
and what checkpointing costs.

Two real agent processes share one SQLite run store (lease 2 s). Their tools and model
are scripted servers in this process (named so: the runtime is what is measured, and a
real model would make hundreds of runs take an hour): every tool call takes 50-250 ms,
every answer 20 words 15 ms apart. CONCURRENCY clients start runs in the background on a
random live replica and read their events; when a stream breaks they re-attach, to
either replica, from the last event they saw. Every KILL_EVERY_S one replica is killed
(SIGKILL) and started again once it is dead. A run is lost when no Final reached its
client within RUN_LIMIT_S; an event is duplicated or missing when its seq is not the
last one seen plus one.

    python -m loadtest.agent_runs --runs 300 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import sqlite3
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import json_format

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc
from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from loadtest.chaos_mesh import free_port
from loadtest.mesh_overhead import write
from mesh import supervisor
from mesh.config import MeshSettings
from mesh.registry import discover
from services.agent.run_store import Lease, SqliteRunStore
from services.tools.builtin import BUILTIN

BEGIN, END = "<!-- agent-runs:begin -->", "<!-- agent-runs:end -->"
CONCURRENCY = 8
KILL_EVERY_S = 4.0
LEASE_S = 2.0
RUN_LIMIT_S = 120.0
QUESTIONS = ("How do I copy a nested list?", "What does json.loads return?", "What is 17*23?")


class ScriptedTools(tools_pb2_grpc.ToolsServiceServicer):
    """The built-in tools' names and schemas; every call a short wait and a passage. A
    key already answered is answered again from memory, as the tools service's
    idempotency store does, and counted."""

    def __init__(self) -> None:
        self.done: dict[str, tools_pb2.CallToolResult] = {}
        self.replayed = 0

    async def ListTools(self, request, context):
        listed = tools_pb2.ListToolsResponse()
        for tool in BUILTIN:
            added = listed.tools.add(name=tool.name, description=tool.description)
            json_format.ParseDict(tool.input_schema, added.input_schema)
        return listed

    async def CallTool(self, request, context):
        if request.idempotency_key in self.done:
            self.replayed += 1
            yield tools_pb2.CallToolResponse(result=self.done[request.idempotency_key])
            return
        await asyncio.sleep(random.uniform(0.05, 0.25))
        result = tools_pb2.CallToolResult()
        result.content.add(text=f"{request.name}: a passage")
        json_format.ParseDict(
            {"passages": [{"id": "copy.deepcopy", "text": "copy.deepcopy copies deeply"}]},
            result.structured_content,
        )
        self.done[request.idempotency_key] = result
        yield tools_pb2.CallToolResponse(result=result)


class ScriptedModel(generation_pb2_grpc.GenerationServiceServicer):
    async def Chat(self, request, context):
        if request.sampling.choices:
            yield generation_pb2.ChatResponse(
                chunk=generation_pb2.GenerationChunk(text="knowledge_search")
            )
        else:
            for n in range(20):
                await asyncio.sleep(0.015)
                chunk = generation_pb2.GenerationChunk(text=f"w{n} ")
                yield generation_pb2.ChatResponse(chunk=chunk)
        yield generation_pb2.ChatResponse(complete=generation_pb2.GenerationComplete())


@dataclass
class Outcome:
    state: int = agent_pb2.RUN_STATE_UNSPECIFIED
    seconds: float = 0.0
    breaks: int = 0
    resumed: bool = False
    out_of_order: int = 0
    waits_s: list[float] = field(default_factory=list)  # stream broken -> next event


@dataclass
class Soak:
    root: Path
    ports: dict[str, int]
    config: Path
    children: dict[str, supervisor.Child] = field(default_factory=dict)
    kills: int = 0

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    async def start(self, name: str) -> None:
        env = {"AIMESH_CONFIG": str(self.config), "OTEL_TRACES_EXPORTER": "none"}
        child = await supervisor.start(
            discover()["agent"],
            MeshSettings(),
            self.root / f"{name}.log",
            port=self.ports[name],
            env=env,
        )
        self.children[name] = child
        took = await supervisor.wait_ready([child], 120)
        if None in took.values():
            raise RuntimeError(f"{name} did not start; see {self.root / name}.log")

    async def chaos(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(KILL_EVERY_S)
            name = random.choice(sorted(self.children))
            process = self.children[name].process
            process.send_signal(signal.SIGKILL)
            await process.wait()
            self.kills += 1
            await self.start(name)


async def _one(soak: Soak, channels: dict[str, grpc.aio.Channel], question: str) -> Outcome:
    outcome, started = Outcome(), time.monotonic()
    last_seq, run_id, broke_at = 0, "", None
    request = agent_pb2.RunRequest(question=question, options=agent_pb2.RunOptions(background=True))
    while time.monotonic() - started < RUN_LIMIT_S:
        stub = agent_pb2_grpc.AgentServiceStub(channels[random.choice(sorted(channels))])
        if run_id:
            call = stub.Attach(agent_pb2.AttachRequest(run_id=run_id, after_seq=last_seq))
        else:
            call = stub.Run(request)
        try:
            async for event in call:
                if broke_at is not None:
                    outcome.waits_s.append(time.monotonic() - broke_at)
                    broke_at = None
                run_id = event.run_id
                outcome.out_of_order += event.seq != last_seq + 1
                last_seq = event.seq
                if event.HasField("final"):
                    outcome.state = event.final.state
                    outcome.resumed = any("resumed" in n for n in event.final.notes)
                    outcome.seconds = time.monotonic() - started
                    return outcome
        except grpc.aio.AioRpcError:
            outcome.breaks += 1
            broke_at = broke_at if broke_at is not None else time.monotonic()
            await asyncio.sleep(0.2)
            if not run_id:
                continue  # never started: start it again
    return outcome  # lost: no Final in time


async def run(runs: int) -> tuple[list[Outcome], Soak, ScriptedTools, dict[str, float]]:
    tools, model = ScriptedTools(), ScriptedModel()
    servers = []
    targets = {}
    for name, register, servicer in (
        ("tools", tools_pb2_grpc.add_ToolsServiceServicer_to_server, tools),
        ("generation", generation_pb2_grpc.add_GenerationServiceServicer_to_server, model),
    ):
        server = grpc.aio.server()
        register(servicer, server)
        targets[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
    with tempfile.TemporaryDirectory(prefix="aimesh-agent-soak-") as work:
        root = Path(work)
        store = root / "runs.sqlite3"
        config = root / "agents.toml"
        config.write_text(
            f'[services.agent]\nrun_store = "{store}"\nlease_s = {LEASE_S}\n'
            f"attach_poll_s = 0.1\nmax_live_runs = 256\n"
            f'[services.agent.dependencies]\ntools = "{targets["tools"]}"\n'
            f'generation = "{targets["generation"]}"\n'
        )
        soak = Soak(root, {"agent-a": free_port(), "agent-b": free_port()}, config)
        outcomes: list[Outcome] = []
        stop = asyncio.Event()
        try:
            await asyncio.gather(soak.start("agent-a"), soak.start("agent-b"))
            channels = {name: grpc.aio.insecure_channel(soak.target(name)) for name in soak.ports}
            chaos = asyncio.create_task(soak.chaos(stop))
            queue = iter(range(runs))

            async def client() -> None:
                for n in queue:
                    outcomes.append(await _one(soak, channels, QUESTIONS[n % len(QUESTIONS)]))

            await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
            stop.set()
            await chaos
            for channel in channels.values():
                await channel.close()
            sizes = _sizes(store)
        finally:
            stop.set()
            await supervisor.stop(list(soak.children.values()), 10)
            for server in servers:
                await server.stop(0)
    sizes["append_ms"] = _append_ms()
    return outcomes, soak, tools, sizes


def _sizes(store: Path) -> dict[str, float]:
    with sqlite3.connect(store) as db:
        checkpoint = db.execute("SELECT avg(length(checkpoint)) FROM runs").fetchone()[0]
        event = db.execute("SELECT avg(length(body)) FROM events").fetchone()[0]
        per_run = db.execute("SELECT avg(events) FROM runs").fetchone()[0]
    return {"checkpoint_bytes": checkpoint or 0, "event_bytes": event or 0, "events": per_run}


def _append_ms(n: int = 500) -> float:
    """One event stored with a checkpoint, as the agent stores each plan and tool result."""
    with tempfile.TemporaryDirectory() as work:
        store = SqliteRunStore(Path(work) / "runs.sqlite3")
        store.create(agent_pb2.RunRequest(question="q"), "r", "", Lease("bench", 10))
        blob = os.urandom(600)
        started = time.perf_counter()
        for seq in range(1, n + 1):
            event = agent_pb2.RunResponse(run_id="r", seq=seq)
            event.tool_result.summary = "5 passages, best 0.82"
            store.append(event, checkpoint=blob)
        took = (time.perf_counter() - started) / n * 1000
        store.close()
    return took


def report(outcomes: list[Outcome], soak: Soak, tools: ScriptedTools, sizes: dict) -> str:
    states = Counter(agent_pb2.RunState.Name(o.state) for o in outcomes)
    lost = states.pop("RUN_STATE_UNSPECIFIED", 0)
    waits = sorted(w for o in outcomes for w in o.waits_s)
    interrupted = [o for o in outcomes if o.breaks]
    p95 = waits[int(0.95 * (len(waits) - 1))] if waits else 0.0
    ended = ", ".join(f"{k.removeprefix('RUN_STATE_')} {v}" for k, v in sorted(states.items()))
    out_of_order = sum(o.out_of_order for o in outcomes)
    median_s = statistics.median(o.seconds for o in outcomes if o.state)
    lines = [
        BEGIN,
        "## Agent runs: random kills, resume, checkpoint cost",
        "",
        f"Command: `python -m loadtest.agent_runs --runs {len(outcomes)}` (`make bench-agent`)."
        f" Machine: {os.cpu_count()} cores, Python {platform.python_version()}. Two agent"
        f" processes on one SQLite run store (lease {LEASE_S:g} s); scripted tools (50-250 ms a"
        " call) and model (20 words, 15 ms apart) in the load generator's process, so the"
        f" runtime is what is measured; {CONCURRENCY} clients run questions in the background"
        " and re-attach from their last event when a stream breaks; one replica is killed"
        f" (SIGKILL) every {KILL_EVERY_S:g} s and started again.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| runs | {len(outcomes)} |",
        f"| replicas killed | {soak.kills} |",
        f"| runs lost (no Final in {RUN_LIMIT_S:g} s) | {lost} |",
        f"| runs whose stream broke / resumed on the other replica | {len(interrupted)} /"
        f" {sum(o.resumed for o in outcomes)} |",
        f"| events duplicated or missing (seq not last + 1) | {out_of_order} |",
        f"| client's wait, stream broken to next event: median / p95 (s) |"
        f" {statistics.median(waits) if waits else 0:.2f} / {p95:.2f} |",
        f"| tool calls re-sent after completing (answered from their idempotency key) |"
        f" {tools.replayed} |",
        f"| terminal states | {ended} |",
        f"| run time, median (s) | {median_s:.2f} |",
        f"| checkpoint, mean compressed size (bytes) | {sizes['checkpoint_bytes']:.0f} |",
        f"| event, mean compressed size (bytes); events per run | {sizes['event_bytes']:.0f};"
        f" {sizes['events']:.0f} |",
        f"| storing one event with its checkpoint (ms, in process) | {sizes['append_ms']:.2f} |",
        "",
        "- A client's wait after a kill is the lease running out, the other replica's next"
        " look (4 per lease) and the run's next step; a run whose replica lives loses nothing"
        " when only its stream breaks.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    outcomes, soak, tools, sizes = asyncio.run(run(args.runs))
    markdown = report(outcomes, soak, tools, sizes)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
