"""The fault suite ("chaos day" on one machine): break one part of a running mesh at a time
under load and count what the callers saw.

The mesh is every service under a supervisor of its own, two decode replicas, and fault
proxies on agent -> tools and tools -> retrieval (loadtest/chaos_mesh.py,
loadtest/faults.py). Each scenario runs a few concurrent clients, injects one fault, ends
it, and measures:

- sent / ok / failed by status code: load requests only (recovery probes are not counted);
  a tool result with is_error counts as TOOL_ERROR. Every request carries a deadline.
- hung: a request still running 2 s past its deadline (a client-side watchdog); goal 0.
- recovery: from the end of the fault (for kill -9: the kill) until a probe request sent
  then succeeds end to end on the path the fault broke.
- ready: for a killed service, until its supervisor's new process answers readiness.
- acknowledged writes lost: retrieval Upserts that returned OK, then not found; goal 0.
- degraded gracefully: the scenario's own test, e.g. the agent still answering, with a
  note, while its tools are cut off.
- failed outside the fault window: for the store scenarios (h, i, j), load requests that
  failed without overlapping the fault; goal 0.

    python -m loadtest.chaos --out docs/reliability.md [--scenarios a,c] [--kill tools,decode]

Exits 1 if any request hung past its deadline, an acknowledged write was lost, or a store
scenario failed a request outside its fault window.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TextIO

import grpc
import psutil
from google.protobuf import struct_pb2

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from aimesh.llm.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
)
from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from loadtest import chaos_mesh
from loadtest.chaos_mesh import REGISTERED, SECOND_DECODE, SECOND_ROUTER, Mesh, sqlite_write_lock
from loadtest.mesh_overhead import write
from mesh import health as mesh_health
from mesh.deployments import FileStore, RedisStore, activate

BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"
COMMAND = "python -m loadtest.chaos --out docs/reliability.md"
HANG_GRACE_S = 2.0
DEADLINE_S = {"generate": 20, "agent": 30, "agent_tool": 30, "tools": 10, "search": 5,
              "write": 5, "image": 30, "registered": 20, "registered_b": 20}  # fmt: skip
BASELINE_S = 3.0
HOLD_S = 10.0
RECOVERY_TIMEOUT_S = 120.0
# Codes a fault may legitimately produce; anything else is a defect, and so is a tool
# error or an agent note that reports a dependency's INTERNAL or UNKNOWN.
CLEAN_FAILURES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED",
                  "TOOL_ERROR"}  # fmt: skip
UNCLEAN_MARKS = ("(INTERNAL)", "(UNKNOWN)")
# An agent note that reports a failure (the planner's remarks about its choice do not).
FAILURE_NOTE = re.compile(r"fail|unavailable|time", re.IGNORECASE)
# The client's own reconnect backoff stays short, so recovery measures the mesh, not it.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
KNOWLEDGE = "knowledge"
WRITES = "chaos_writes"
PASSAGES = {
    "copy.deepcopy": "copy.deepcopy(x, memo=None)\n\nDeep copy operation on arbitrary Python "
    "objects: nested lists and dicts are copied recursively.",
    "json.loads": "json.loads(s)\n\nDeserialize s (a str containing a JSON document) to a "
    "Python object.",
    "shutil.rmtree": "shutil.rmtree(path)\n\nRecursively delete a directory tree.",
    "os.listdir": "os.listdir(path='.')\n\nReturn a list containing the names of the entries "
    "in the directory given by path.",
}
CALCULATION = "What is (17*23)+4?"
QUESTIONS = (
    "How do I make a deep copy of a nested list?",
    CALCULATION,
    "How do I remove a directory tree?",
    "What does json.loads return?",
)
QUERIES = ("copy a nested list", "parse JSON text", "delete a directory tree")
PROMPT = "The capital of France is"
DECODES = ("decode", SECOND_DECODE)
# What the path a killed service sits on is probed with (end to end, from outside).
PROBE = {
    "agent": "agent", "tools": "tools", "generation": "generate", "tokenizer": "generate",
    "prefill": "generate", "decode": "generate", "embedder": "search", "retrieval": "search",
    "rerank": "tools", "diffusion": "image",
}  # fmt: skip


@dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    code: str  # OK, a status code's name, TOOL_ERROR, INCOMPLETE or HUNG
    detail: str = ""
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    def overlaps(self, start: float, end: float) -> bool:
        return self.started <= end and self.ended >= start


Result = tuple[str, str, tuple[str, ...]]  # code, detail, notes


class Traffic:
    """The suite's clients: one request of a kind at a time, or loops of them."""

    def __init__(self, mesh: Mesh) -> None:
        def channel(name: str) -> grpc.aio.Channel:
            return grpc.aio.insecure_channel(mesh[name].target, options=CLIENT_OPTIONS)

        self.channels = {name: channel(name) for name in mesh.processes}
        # A client of its own: unread streams must not hold the others' connection window.
        self.slow_channel = channel("generation")
        self.agent = agent_pb2_grpc.AgentServiceStub(self.channels["agent"])
        self.tools = tools_pb2_grpc.ToolsServiceStub(self.channels["tools"])
        self.generation = generation_pb2_grpc.GenerationServiceStub(self.channels["generation"])
        self.routers = {
            name: generation_pb2_grpc.GenerationServiceStub(self.channels[name])
            for name in ("generation", SECOND_ROUTER)
        }
        self.retrieval = retrieval_pb2_grpc.RetrievalServiceStub(self.channels["retrieval"])
        self.diffusion = diffusion_pb2_grpc.DiffusionServiceStub(self.channels["diffusion"])
        self.decodes = {
            name: decode_pb2_grpc.DecodeServiceStub(self.channels[name]) for name in DECODES
        }
        self.bodies: dict[str, Callable[[float], Awaitable[Result]]] = {
            "generate": self._generate,
            "agent": self._agent,
            "agent_tool": self._agent_tool,
            "tools": self._tool,
            "search": self._search,
            "write": self._write,
            "image": self._image,
            "registered": partial(self._registered, "generation"),
            "registered_b": partial(self._registered, SECOND_ROUTER),
        }
        self.acked: list[str] = []
        self.probes: list[Outcome] = []  # every recovery probe, for the outcomes dump
        self.in_flight = 0
        self._busy = asyncio.Event()  # set while any request is in flight
        self._sequence = itertools.count()
        self._run = f"{os.getpid()}-{int(time.time())}"

    async def close(self) -> None:
        for channel in [*self.channels.values(), self.slow_channel]:
            await channel.close()

    async def send(self, kind: str, deadline_s: float | None = None) -> Outcome:
        """One request of `kind` within its deadline (by default the kind's own), classified;
        never raises for an RPC."""
        deadline_s = deadline_s or DEADLINE_S[kind]
        started = time.monotonic()
        self.in_flight += 1
        self._busy.set()
        detail, notes = "", ()
        try:
            code, detail, notes = await asyncio.wait_for(
                self.bodies[kind](deadline_s), deadline_s + HANG_GRACE_S
            )
        except TimeoutError:
            code = "HUNG"
        except grpc.aio.AioRpcError as error:
            code, detail = error.code().name, error.details() or ""
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._busy.clear()
        return Outcome(kind, started, time.monotonic(), code, detail, notes)

    @contextlib.asynccontextmanager
    async def loading(
        self, load: dict[str, int], deadline_s: float | None = None
    ) -> AsyncIterator[list[Outcome]]:
        """`load[kind]` clients per kind, each sending back to back (a short pause after a
        failure, as a client would) until the block ends; in-flight requests are finished,
        not cancelled, so every one is classified."""
        outcomes: list[Outcome] = []
        stop = asyncio.Event()

        async def client(kind: str) -> None:
            while not stop.is_set():
                outcome = await self.send(kind, deadline_s)
                outcomes.append(outcome)
                await asyncio.sleep(0.1 if outcome.ok else 0.5)

        clients = [asyncio.create_task(client(k)) for k, n in load.items() for _ in range(n)]
        try:
            yield outcomes
        finally:
            stop.set()
            await asyncio.gather(*clients)

    async def mid_request(self, timeout_s: float = 2.0) -> int:
        """Waits (briefly) for a moment with requests in flight, so that a kill lands
        mid-request; returns how many are."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._busy.wait(), timeout_s)
        return self.in_flight

    async def until_ok(self, kind: str, timeout_s: float = RECOVERY_TIMEOUT_S) -> float | None:
        """When (time.monotonic()) the first request of `kind` that succeeded was sent."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            outcome = await self.send(kind)
            self.probes.append(outcome)
            if outcome.ok:
                return outcome.started
            await asyncio.sleep(0.25)
        return None

    async def until_version(
        self, kind: str, version: str, timeout_s: float = RECOVERY_TIMEOUT_S
    ) -> float | None:
        """When the first request of `kind` that `version` of the registered model served
        was sent."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            outcome = await self.send(kind)
            self.probes.append(outcome)
            if outcome.ok and outcome.detail == version:
                return outcome.started
            await asyncio.sleep(0.25)
        return None

    async def until_decode_idle(self, timeout_s: float = RECOVERY_TIMEOUT_S) -> float | None:
        """When both decode replicas first report nothing running or waiting."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if sum([await self.decode_busy(name) for name in DECODES]) == 0:
                return time.monotonic()
            await asyncio.sleep(0.2)
        return None

    async def decode_busy(self, name: str) -> int:
        load = await self.decodes[name].GetLoad(decode_pb2.GetLoadRequest(), timeout=2)
        return load.running + load.waiting

    async def unread(self, max_new_tokens: int, deadline_s: float) -> Outcome:
        """A Generate stream started and then never read, until it ends (by its deadline)."""
        stub = generation_pb2_grpc.GenerationServiceStub(self.slow_channel)
        started = time.monotonic()
        call = stub.Generate(self._generate_request(max_new_tokens), timeout=deadline_s)
        try:
            code = await asyncio.wait_for(call.code(), deadline_s + HANG_GRACE_S)
        except TimeoutError:
            call.cancel()
            return Outcome("unread", started, time.monotonic(), "HUNG")
        name = "OK" if code is grpc.StatusCode.OK else code.name
        return Outcome("unread", started, time.monotonic(), name, await call.details() or "")

    async def prepare(self) -> None:
        """The knowledge collection and the writes' collection, then one success of each
        kind, so that scenarios start from a mesh that works end to end."""
        for collection in (KNOWLEDGE, WRITES):
            await self.retrieval.CreateCollection(
                retrieval_pb2.CreateCollectionRequest(collection=collection, sparse_enabled=True),
                timeout=60,
            )

        async def passages() -> AsyncIterator[retrieval_pb2.UpsertRequest]:
            for doc_id, text in PASSAGES.items():
                payload = struct_pb2.Struct()
                payload.update({"title": doc_id, "source": "stdlib", "part": 1})
                document = retrieval_pb2.Document(id=doc_id, text=text, payload=payload)
                yield retrieval_pb2.UpsertRequest(collection=KNOWLEDGE, documents=[document])

        await self.retrieval.Upsert(passages(), timeout=60)
        kinds = ("search", "tools", "generate", "agent_tool", "image", "write", "registered",
                 "registered_b")  # fmt: skip
        for kind in kinds:
            if await self.until_ok(kind, timeout_s=180) is None:
                raise RuntimeError(f"the mesh does not serve {kind} requests")

    async def lost_writes(self) -> list[str]:
        """Acknowledged writes that a search for their own id does not find."""
        lost = []
        for doc_id in self.acked:
            found = await self.retrieval.Search(
                retrieval_pb2.SearchRequest(
                    collection=WRITES,
                    query=self._write_text(doc_id),
                    top_k=1,
                    filter=retrieval_pb2.Filter(
                        must=[retrieval_pb2.Condition(key="wid", keyword=doc_id)]
                    ),
                ),
                timeout=10,
            )
            if doc_id not in [hit.id for hit in found.hits]:
                lost.append(doc_id)
        return lost

    def _generate_request(self, max_new_tokens: int) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            prompt=PROMPT,
            sampling=sampling_pb2.SamplingParameters(temperature=0),
            stopping=sampling_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        )

    async def _generate(self, deadline_s: float) -> Result:
        async for response in self.generation.Generate(
            self._generate_request(32), timeout=deadline_s
        ):
            if response.HasField("complete"):
                return "OK", response.complete.decode_worker, ()
        return "INCOMPLETE", "the stream ended without GenerationComplete", ()

    async def _registered(self, router: str, deadline_s: float) -> Result:
        """A Generate of the registered model on `router`: the version that served it."""
        request = self._generate_request(8)
        request.model = REGISTERED
        async for response in self.routers[router].Generate(request, timeout=deadline_s):
            if response.HasField("complete"):
                return "OK", response.complete.model_version, ()
        return "INCOMPLETE", "the stream ended without GenerationComplete", ()

    async def _agent(self, deadline_s: float, question: str = "", whole: bool = False) -> Result:
        question = question or QUESTIONS[next(self._sequence) % len(QUESTIONS)]
        request = agent_pb2.RunRequest(
            question=question, options=agent_pb2.RunOptions(max_new_tokens=32, seed=1)
        )
        tool_answered = False
        async for event in self.agent.Run(request, timeout=deadline_s):
            kind = event.WhichOneof("event")
            if kind == "tool_result" and not event.tool_result.is_error:
                tool_answered = True
            elif kind == "final":
                notes = tuple(event.final.notes)
                if whole and not tool_answered:
                    return "TOOL_ERROR", "answered without a tool result", notes
                if whole and any(FAILURE_NOTE.search(note) for note in notes):
                    return "DEGRADED", "answered with a note of a failure", notes
                return "OK", "", notes
        return "INCOMPLETE", "the stream ended without Final", ()

    async def _agent_tool(self, deadline_s: float) -> Result:
        """An agent run that counts only if the whole agent path works: a tool answered and
        no note reports a failure (of the planning model, the answer, a tool)."""
        return await self._agent(deadline_s, CALCULATION, whole=True)

    async def _tool(self, deadline_s: float) -> Result:
        arguments = struct_pb2.Struct()
        arguments.update({"query": QUERIES[next(self._sequence) % len(QUERIES)]})
        request = tools_pb2.CallToolRequest(name="knowledge_search", arguments=arguments)
        async for event in self.tools.CallTool(request, timeout=deadline_s):
            if event.HasField("result"):
                if event.result.is_error:
                    return "TOOL_ERROR", " ".join(c.text for c in event.result.content), ()
                return "OK", "", ()
        return "INCOMPLETE", "the stream ended without a result", ()

    async def _search(self, deadline_s: float) -> Result:
        query = QUERIES[next(self._sequence) % len(QUERIES)]
        request = retrieval_pb2.SearchRequest(collection=KNOWLEDGE, query=query, top_k=3)
        found = await self.retrieval.Search(request, timeout=deadline_s)
        return ("OK", "", ()) if found.hits else ("INCOMPLETE", "no hits", ())

    def _write_text(self, doc_id: str) -> str:
        return f"chaos write {doc_id}: an acknowledged write must survive a crash"

    async def _write(self, deadline_s: float) -> Result:
        doc_id = f"w{next(self._sequence)}-{self._run}"
        payload = struct_pb2.Struct()
        payload.update({"wid": doc_id})
        document = retrieval_pb2.Document(id=doc_id, text=self._write_text(doc_id), payload=payload)

        async def requests() -> AsyncIterator[retrieval_pb2.UpsertRequest]:
            yield retrieval_pb2.UpsertRequest(collection=WRITES, documents=[document])

        response = await self.retrieval.Upsert(requests(), timeout=deadline_s)
        if list(response.ids) != [doc_id]:
            return "INCOMPLETE", f"acknowledged ids {list(response.ids)}", ()
        self.acked.append(doc_id)
        return "OK", "", ()

    async def _image(self, deadline_s: float) -> Result:
        request = diffusion_pb2.GenerateRequest(model="digits", prompt="3", steps=10, seed=1)
        async for event in self.diffusion.Generate(request, timeout=deadline_s):
            if event.HasField("summary"):
                return "OK", "", ()
        return "INCOMPLETE", "the stream ended without Summary", ()


@dataclass
class Row:
    scenario: str
    outcomes: list[Outcome]
    recovery_s: float | None = None
    ready_s: float | None = None
    lost: int | None = None
    graceful: str = "n.a."
    notes: list[str] = field(default_factory=list)
    # Store scenarios: load requests that failed without overlapping the fault.
    failed_outside: int | None = None

    @property
    def hung(self) -> int:
        return sum(o.code == "HUNG" for o in self.outcomes)

    @property
    def unclean(self) -> list[Outcome]:
        return [
            o for o in self.outcomes
            if (not o.ok and o.code not in CLEAN_FAILURES)
            or any(mark in text for text in (o.detail, *o.notes) for mark in UNCLEAN_MARKS)
        ]  # fmt: skip


def since(mark: float | None, start: float) -> float | None:
    return None if mark is None else max(0.0, mark - start)


def served_by(mesh: Mesh, streams: list[Outcome]) -> str:
    """How many streams each decode replica served, by the worker GenerationComplete named."""
    names = {mesh[name].target: name for name in DECODES}
    count = Counter(names.get(o.detail, o.detail) for o in streams)
    return ", ".join(f"{n} by {name}" for name, n in sorted(count.items())) or "none"


def agent_verdict(outcomes: list[Outcome], start: float, end: float) -> tuple[str, str]:
    """Graceful when every agent run that overlapped the fault still answered; the note
    says how many answered, how many said that something failed, and what most often."""
    runs = [o for o in outcomes if o.kind == "agent" and o.overlaps(start, end)]
    if not runs:
        return "n.a.", "no agent run overlapped the fault"
    answered = [o for o in runs if o.ok]
    noted = [o for o in answered if any(FAILURE_NOTE.search(note) for note in o.notes)]
    said_most = Counter(note[:90] for o in noted for note in o.notes if FAILURE_NOTE.search(note))
    distinct = [note for note, _ in said_most.most_common(2)]
    said = f": {'; '.join(repr(note) for note in distinct)}" if distinct else ""
    verdict = "yes" if len(answered) == len(runs) else "no"
    return verdict, f"agent answered {len(answered)}/{len(runs)}, {len(noted)} with a note{said}"


def judge(row: Row, verdict: str) -> Row:
    """A failure outside the clean codes or a hang overrides any scenario's own verdict."""
    row.graceful = "no" if row.unclean or row.hung else verdict
    for outcome in row.unclean[:2]:
        said = " ".join([outcome.detail, *outcome.notes])
        row.notes.append(f"DEFECT? {outcome.kind} {outcome.code}: {said[:160]!r}")
    return row


async def kill_service(mesh: Mesh, traffic: Traffic, name: str) -> Row:
    """a. kill -9 of one service's process mid-stream; its supervisor restarts it."""
    load = {"generate": 1, "agent": 1, "tools": 1, "search": 1}
    if PROBE[name] == "image":
        load["image"] = 1
    async with traffic.loading(load) as outcomes:
        await asyncio.sleep(BASELINE_S)
        in_flight = await traffic.mid_request()
        killed_at = time.monotonic()
        pid = mesh.kill(name)
        recovered, ready_s, whole = await asyncio.gather(
            traffic.until_ok(PROBE[name]),
            mesh.ready_again(name, pid, RECOVERY_TIMEOUT_S),
            traffic.until_ok("agent_tool"),
        )
        # The next kill starts from a mesh whole again, the restarted service included.
        await traffic.until_ok("agent_tool")
    row = Row(f"a. kill -9 {name}", list(outcomes), since(recovered, killed_at), ready_s)
    outage_end = killed_at + max(row.recovery_s or 0, ready_s or 0)
    verdict, said = (
        ("n.a.", "") if name == "agent" else agent_verdict(outcomes, killed_at, outage_end)
    )
    row.notes += [
        f"{in_flight} requests (all kinds) in flight at the kill",
        *mesh[name].restarts()[-1:],
        f"agent whole again {seconds(since(whole, killed_at))} s after the kill",
    ]
    row.notes += [said] if said else []
    return judge(row, verdict)


async def pause_service(mesh: Mesh, traffic: Traffic, name: str) -> Row:
    """b. SIGSTOP of one service for HOLD_S, then SIGCONT: a hang, not a crash. Streams
    get a deadline shorter than the hang, so those stuck on the stopped replica must end by
    it; the other kinds' deadlines already are."""
    load = {"agent": 2, "tools": 1} if name == "tools" else {"generate": 3}
    deadline_s = None if name == "tools" else HOLD_S * 0.8
    async with traffic.loading(load, deadline_s) as outcomes:
        await asyncio.sleep(BASELINE_S)
        stopped_at = time.monotonic()
        pid = mesh.pause(name)
        await asyncio.sleep(HOLD_S)
        mesh.resume(pid)
        resumed_at = time.monotonic()
        recovered = await traffic.until_ok("tools" if name == "tools" else "generate")
        await asyncio.sleep(2)
    row = Row(f"b. SIGSTOP {name} {HOLD_S:g} s", list(outcomes), since(recovered, resumed_at))
    if name == "tools":
        verdict, said = agent_verdict(outcomes, stopped_at, resumed_at)
        row.notes.append(said)
    else:
        # Streams started once the router's load poll could see the hang must avoid it.
        later = [
            o for o in outcomes
            if o.kind == "generate" and stopped_at + 1 < o.started < resumed_at
        ]  # fmt: skip
        served = [o for o in later if o.ok]
        verdict = "yes" if later and len(served) == len(later) else "no"
        row.notes.append(
            f"streams started 1 s into the hang: {len(served)}/{len(later)} served "
            f"({served_by(mesh, served)})"
        )
    stuck = [o for o in outcomes if o.code == "DEADLINE_EXCEEDED"]
    row.notes.append(f"{len(stuck)} calls ended by their deadline")
    return judge(row, verdict)


async def partition_agent_tools(mesh: Mesh, traffic: Traffic) -> Row:
    """c. agent <-> tools partitioned (blackhole) for HOLD_S."""
    proxy = mesh.proxies[("agent", "tools")]
    async with traffic.loading({"agent": 3}) as outcomes:
        await asyncio.sleep(BASELINE_S)
        cut_at = time.monotonic()
        proxy.set_blackhole()
        await asyncio.sleep(HOLD_S)
        proxy.set_pass()
        healed_at = time.monotonic()
        recovered = await traffic.until_ok("agent_tool")
        await asyncio.sleep(1)
    row = Row(f"c. partition agent-tools {HOLD_S:g} s", list(outcomes), since(recovered, healed_at))
    verdict, said = agent_verdict(outcomes, cut_at, healed_at)
    row.notes += [said, f"{proxy.reset_connections} cut connections reset at the heal"]
    return judge(row, verdict)


async def store_unavailable(mesh: Mesh, traffic: Traffic) -> Row:
    """d. The vector store's service unreachable from tools (every connection reset) for
    HOLD_S, then back."""
    proxy = mesh.proxies[("tools", "retrieval")]
    async with traffic.loading({"tools": 2, "agent": 1}) as outcomes:
        await asyncio.sleep(BASELINE_S)
        cut_at = time.monotonic()
        proxy.set_reset()
        await asyncio.sleep(HOLD_S)
        proxy.set_pass()
        back_at = time.monotonic()
        recovered = await traffic.until_ok("tools")
        await asyncio.sleep(1)
    row = Row(f"d. store unreachable {HOLD_S:g} s", list(outcomes), since(recovered, back_at))
    searches = [o for o in outcomes if o.kind == "tools" and o.overlaps(cut_at, back_at)]
    clean = [o for o in searches if o.code in ("OK", "TOOL_ERROR", "UNAVAILABLE")]
    verdict, said = agent_verdict(outcomes, cut_at, back_at)
    errors = sorted({o.detail[:80] for o in searches if o.code == "TOOL_ERROR"})
    row.notes += [
        f"knowledge_search during the outage: {len(clean)}/{len(searches)} clean "
        f"(ok, tool error or UNAVAILABLE){': ' + repr(errors[0]) if errors else ''}",
        said,
    ]
    return judge(row, verdict if len(clean) == len(searches) else "no")


async def lose_decode_replica(mesh: Mesh, traffic: Traffic) -> Row:
    """e. One of two decode replicas killed -9 with streams on both."""
    async with traffic.loading({"generate": 4}) as outcomes:
        await asyncio.sleep(BASELINE_S + 5)  # long enough for streams to finish on both
        on_victim = await traffic.decode_busy(SECOND_DECODE)
        killed_at = time.monotonic()
        pid = mesh.kill(SECOND_DECODE)
        ready = asyncio.create_task(mesh.ready_again(SECOND_DECODE, pid, RECOVERY_TIMEOUT_S))
        await asyncio.sleep(HOLD_S / 2)
        ready_s = await ready
    recovered = min((o.started for o in outcomes if o.started > killed_at and o.ok), default=None)
    row = Row(
        "e. decode replica lost (1 of 2)", list(outcomes), since(recovered, killed_at), ready_s
    )
    before = [o for o in outcomes if o.started <= killed_at and o.ended >= killed_at]
    after = [o for o in outcomes if o.started > killed_at]
    failed_after = [o for o in after if not o.ok]
    earlier = [o for o in outcomes if o.ended < killed_at and o.ok]
    row.notes += [
        f"before the kill {served_by(mesh, earlier)}",
        f"{on_victim} streams on the killed replica, {len(before)} in flight in all: "
        f"{sum(not o.ok for o in before)} failed",
        f"started after the kill: {len(after) - len(failed_after)}/{len(after)} served "
        f"({served_by(mesh, [o for o in after if o.ok])})",
    ]
    failed_before = sum(not o.ok for o in before)
    return judge(row, "yes" if not failed_after and failed_before <= on_victim else "no")


async def slow_reader(mesh: Mesh, traffic: Traffic) -> Row:
    """f. A client opens long streams and never reads them, while others generate."""
    slow_s, streams = HOLD_S, 3
    async with traffic.loading({"generate": 2}) as outcomes:
        await asyncio.sleep(BASELINE_S)
        opened_at = time.monotonic()
        unread = [asyncio.create_task(traffic.unread(1024, slow_s)) for _ in range(streams)]
        await asyncio.sleep(slow_s / 2)
        busy_mid = [await traffic.decode_busy(n) for n in DECODES]
    # The others stop halfway (their last streams finish meanwhile), so that once the
    # unread streams' deadline passes, decode's work left is theirs alone.
    deadline_at = opened_at + slow_s
    slow = list(await asyncio.gather(*unread))
    idle_at = await traffic.until_decode_idle()
    row = Row(f"f. slow reader {slow_s:g} s", [*outcomes, *slow], since(idle_at, deadline_at))

    def p50(picked: list[Outcome]) -> str:
        return f"{statistics.median(o.ended - o.started for o in picked):.1f} s" if picked else "-"

    before = [o for o in outcomes if o.started < opened_at and o.ok]
    during = [o for o in outcomes if o.overlaps(opened_at, deadline_at)]
    served = [o for o in during if o.ok]
    ends = ", ".join(sorted({o.code for o in slow}))
    row.notes += [
        f"{streams} unread streams of 1024 tokens: {ends}; decode "
        f"busy {sum(busy_mid)} midway; recovery = deadline -> decode idle",
        f"others: {len(served)}/{len(during)} served, p50 {p50(before)} before, "
        f"{p50(served)} during",
    ]
    return judge(row, "yes" if during and len(served) == len(during) and idle_at else "no")


async def acknowledged_writes(mesh: Mesh, traffic: Traffic) -> Row:
    """g. Upserts acknowledged one by one, retrieval killed -9 among them, then each
    acknowledged document searched for."""
    async with traffic.loading({"write": 4}) as outcomes:
        await asyncio.sleep(BASELINE_S)
        in_flight = await traffic.mid_request()
        killed_at = time.monotonic()
        pid = mesh.kill("retrieval")
        ready = asyncio.create_task(mesh.ready_again("retrieval", pid, RECOVERY_TIMEOUT_S))
        recovered = await traffic.until_ok("write")
        ready_s = await ready
        await asyncio.sleep(1)
    lost = await traffic.lost_writes()
    row = Row(
        "g. acknowledged writes, kill -9 retrieval", list(outcomes), since(recovered, killed_at)
    )
    row.ready_s, row.lost = ready_s, len(lost)
    row.notes += [
        f"{len(traffic.acked)} writes acknowledged, {in_flight} in flight at the kill",
        *mesh["retrieval"].restarts()[-1:],
    ]
    row.notes += [f"lost: {', '.join(lost[:5])}"] if lost else []
    return judge(row, "n.a.")


@dataclass
class HealthSamples:
    """One health name of one process, asked every 0.2 s while a scenario runs."""

    target: str
    name: str
    seen: list[tuple[float, str]] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[HealthSamples]:
        async def sample() -> None:
            while True:
                status = await mesh_health.probe(self.target, self.name, 1.0)
                self.seen.append((time.monotonic(), status))
                await asyncio.sleep(0.2)

        task = asyncio.create_task(sample())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def said(self, start: float, end: float) -> str:
        """When the name went NOT_SERVING after `start` and SERVING again after that,
        relative to the fault's start and end."""
        down = next((t for t, s in self.seen if t >= start and s == "NOT_SERVING"), None)
        if down is None:
            return f"{self.name} never NOT_SERVING"
        up = next((t for t, s in self.seen if t > down and s == "SERVING"), None)
        back = "never SERVING again" if up is None else f"SERVING {up - end:+.1f} s after its end"
        return f"{self.name} NOT_SERVING {down - start:.1f} s into the fault, {back}"


def store_verdict(
    row: Row,
    mesh: Mesh,
    name: str,
    pid: int | None,
    health: HealthSamples,
    start: float,
    end: float,
    kind: str,
) -> Row:
    """A store fault is weathered when nothing failed outside its window, the process
    that depends on the store was not restarted, and its health said so."""  # fmt: skip
    outside = [o for o in row.outcomes if not o.ok and not o.overlaps(start, end)]
    inside = [o for o in row.outcomes if o.kind == kind and o.overlaps(start, end)]
    row.failed_outside = len(outside)
    kept = pid is not None and mesh[name].service_pid() == pid
    said = health.said(start, end)
    versions = Counter(o.detail for o in inside if o.ok)
    row.notes += [
        f"{kind} during the fault: {sum(o.ok for o in inside)}/{len(inside)} ok"
        + (f" ({', '.join(f'{n} by {v}' for v, n in sorted(versions.items()))})"
           if kind.startswith("registered") else ""),
        said,
        f"{name} {'kept its process' if kept else 'RESTARTED'}",
        f"failed outside the fault window: {len(outside)}",
    ]  # fmt: skip
    reported = "NOT_SERVING" in said and "never SERVING" not in said
    return judge(row, "yes" if not outside and kept and reported else "no")


SPOILED = {
    "an unknown field": lambda good: good.replace('"revision"', '"colour": "red", "revision"', 1),
    "cut short": lambda good: good[: len(good) // 2],
}


async def registry_file_corrupted(mesh: Mesh, traffic: Traffic) -> Row:
    """h. generation-b's registry file spoiled under load for HOLD_S (a field it does not
    know, then cut short), then put right with v2 activated."""
    path = mesh.registry_file
    good = path.read_text()
    health = HealthSamples(mesh[SECOND_ROUTER].target, "generation.registry")
    async with traffic.loading({"registered_b": 2}) as outcomes, health.sampling():
        await asyncio.sleep(BASELINE_S)
        pid = mesh[SECOND_ROUTER].service_pid()
        spoiled_at = time.monotonic()
        for spoil in SPOILED.values():
            path.write_text(spoil(good))
            await asyncio.sleep(HOLD_S / len(SPOILED))
        path.write_text(good)
        FileStore(path).update(lambda state: activate(state, REGISTERED, "v2", "chaos"))
        fixed_at = time.monotonic()
        recovered = await traffic.until_version("registered_b", "v2")
        await asyncio.sleep(2)
    row = Row(
        f"h. registry file corrupted {HOLD_S:g} s", list(outcomes), since(recovered, fixed_at)
    )
    return store_verdict(
        row, mesh, SECOND_ROUTER, pid, health, spoiled_at, fixed_at, "registered_b"
    )


async def registry_redis_down(mesh: Mesh, traffic: Traffic) -> Row:
    """i. The redis-server the generation router's registry is in killed -9 under load,
    started again (with its data) after HOLD_S, then v2 activated in it."""
    health = HealthSamples(mesh["generation"].target, "generation.registry")
    async with traffic.loading({"registered": 2}) as outcomes, health.sampling():
        await asyncio.sleep(BASELINE_S)
        pid = mesh["generation"].service_pid()
        down_at = time.monotonic()
        await asyncio.to_thread(mesh.redis.kill)
        await asyncio.sleep(HOLD_S)
        await asyncio.to_thread(mesh.redis.start)
        back_at = time.monotonic()
        store = RedisStore(mesh.redis.url)
        await asyncio.to_thread(
            store.update, lambda state: activate(state, REGISTERED, "v2", "chaos")
        )
        store.close()
        recovered = await traffic.until_version("registered", "v2")
        await asyncio.sleep(2)
    row = Row(f"i. registry Redis down {HOLD_S:g} s", list(outcomes), since(recovered, back_at))
    return store_verdict(row, mesh, "generation", pid, health, down_at, back_at, "registered")


async def run_store_write_fails(mesh: Mesh, traffic: Traffic) -> Row:
    """j. The agent's run store refuses every write for HOLD_S (its SQLite write lock held
    by another process), under load."""
    health = HealthSamples(mesh["agent"].target, "agent.run_store")
    async with traffic.loading({"agent": 2}) as outcomes, health.sampling():
        await asyncio.sleep(BASELINE_S + 5)  # a run takes seconds: some end before the fault
        pid = mesh["agent"].service_pid()
        locked_at = time.monotonic()
        with sqlite_write_lock(mesh.run_store):
            await asyncio.sleep(HOLD_S)
        released_at = time.monotonic()
        recovered = await traffic.until_ok("agent")
        await asyncio.sleep(2)
    row = Row(
        f"j. run-store write fails {HOLD_S:g} s", list(outcomes), since(recovered, released_at)
    )
    lost = [o for o in outcomes if o.code == "UNAVAILABLE" and "re-attach" in o.detail]
    row.notes.append(f"{len(lost)} runs stopped for their lapsed lease (re-attach)")
    return store_verdict(row, mesh, "agent", pid, health, locked_at, released_at, "agent")


PAUSED = ("tools", "decode")
SCENARIOS: dict[str, Callable[[Mesh, Traffic], Awaitable[Row]]] = {
    "c": partition_agent_tools,
    "d": store_unavailable,
    "e": lose_decode_replica,
    "f": slow_reader,
    "g": acknowledged_writes,
    "h": registry_file_corrupted,
    "i": registry_redis_down,
    "j": run_store_write_fails,
}


def dump(row: Row, probes: list[Outcome], out: TextIO) -> None:
    """Every request of a scenario, its probes too, as JSON lines stamped with the wall
    clock to match the services' logs."""
    to_wall = time.time() - time.monotonic()
    for probe, outcomes in ((False, row.outcomes), (True, probes)):
        for outcome in outcomes:
            at = time.strftime("%H:%M:%S", time.localtime(outcome.started + to_wall))
            record = {"scenario": row.scenario, "probe": probe, "at": at, **asdict(outcome)}
            out.write(json.dumps(record) + "\n")


async def run(scenarios: str, kill: list[str]) -> tuple[list[Row], Path]:
    work_dir = Path(tempfile.mkdtemp(prefix="aimesh-chaos-"))
    print(f"starting the mesh; logs under {work_dir}/logs", flush=True)
    mesh = await chaos_mesh.start(work_dir)
    rows: list[Row] = []
    try:
        traffic = Traffic(mesh)
        await traffic.prepare()
        traffic.probes.clear()
        plan: list[Callable[[], Awaitable[Row]]] = []
        for letter in scenarios:
            if letter == "a":
                plan += [partial(kill_service, mesh, traffic, name) for name in kill]
            elif letter == "b":
                plan += [partial(pause_service, mesh, traffic, name) for name in PAUSED]
            else:
                plan.append(partial(SCENARIOS[letter], mesh, traffic))
        with (work_dir / "outcomes.jsonl").open("w") as out:
            for scenario in plan:
                began = time.strftime("%H:%M:%S")
                rows.append(await scenario())
                print(began, table(rows[-1:]).splitlines()[-1], flush=True)
                dump(rows[-1], traffic.probes, out)
                traffic.probes.clear()
        await traffic.close()
    finally:
        mesh.stop()
        await mesh.close_proxies()
    return rows, mesh.log_dir


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| scenario | sent | ok | failed (by code) | hung | recovery s | restarted, ready s "
        "| acked writes lost | degraded gracefully | notes |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        failed = Counter(
            f"{o.kind} {o.code}" for o in row.outcomes if not o.ok and o.code != "HUNG"
        )
        lines.append(
            f"| {row.scenario} | {len(row.outcomes)} | {sum(o.ok for o in row.outcomes)} | "
            f"{', '.join(f'{what} {n}' for what, n in failed.most_common()) or '-'} | "
            f"{row.hung} | {seconds(row.recovery_s)} | {seconds(row.ready_s)} | "
            f"{'-' if row.lost is None else row.lost} | {row.graceful} | "
            f"{'; '.join(row.notes).replace('|', '/')} |"
        )
    return "\n".join(lines)


FAULTS = """\
- **a. kill -9**: SIGKILL of the service's process (not its supervisor): no drain, its
  sockets reset. The supervisor (`aimesh up --only NAME`) restarts it after its backoff
  (1 s, doubling to 30 s in a crash loop). Recovery is measured on the path the service
  sits on; a path that never broke (a second decode replica, rerank's fallback to
  retrieval order) recovers in 0 s while the service itself is still restarting.
- **b. SIGSTOP**: the process keeps its sockets and answers nothing for 10 s, then gets
  SIGCONT: a hang, not a crash. Callers can only end such calls by their deadline.
- **c. partition agent <-> tools**: the proxy on that edge swallows every byte both ways
  and forwards nothing for 10 s (new connections are accepted and swallowed too); when
  the partition ends the connections it cut are reset, as TCP gives up on a long
  partition.
- **d. vector store unavailable**: the Qdrant store is embedded in the retrieval process
  here (no Qdrant server installs on this machine), so "the store unavailable" is its
  service unreachable from tools: every connection on tools -> retrieval reset and every
  new one answered with an RST for 10 s. kill -9 of retrieval (a, g) covers the store's
  process dying.
- **e. decode replica lost**: the second of two decode replicas killed -9 with streams on
  both; the generation router balances them by polled load.
- **f. slow reader**: a client of its own opens three 1024-token Generate streams and
  never reads them, until their 10 s deadline; two other clients keep generating.
- **g. acknowledged writes**: four clients upsert one document per call; retrieval is
  killed -9 among them; every document whose Upsert returned OK is then searched for by
  its id.
- **h. registry file corrupted**: a second router (generation-b) follows a registry file
  holding a registered model (v1 active); two clients generate from that model while the
  file gets a field the router does not know (5 s), then is cut in half (5 s); then it is
  put right and v2 activated in it. Recovery: from the fix until a request is served by
  v2. The router must keep serving v1 from its last valid table and say so (its
  `generation.registry` health NOT_SERVING), not exit.
- **i. registry Redis down**: the redis-server holding the generation router's registry
  (appendonly) is killed -9 for 10 s under the same load, then started again with its
  data and v2 activated in it. Recovery: from the restart until a request is served by v2.
- **j. run-store write fails**: the agent's SQLite run store refuses every write for 10 s
  (another process holds its write lock, so each write fails after busy_timeout, 5 s: a
  failure injected at the store's edge, as a full disk fails writes), under two clients
  asking the agent. New runs are refused UNAVAILABLE; a run whose lease lapsed meanwhile
  stops where it ran (UNAVAILABLE, re-attach) and goes on once the agent claims it again.
  Recovery: from the lock's release until a run succeeds. Failed outside the fault window
  (a request that did not overlap the fault and still failed) must be 0 for h, i and j."""


def report(rows: list[Row]) -> str:
    cores, memory = os.cpu_count(), psutil.virtual_memory().total / 2**30
    return "\n".join(
        [
            BEGIN,
            "## Fault suite",
            "",
            f"`{COMMAND}` (`make chaos`), {time.strftime('%Y-%m-%d')}: the whole mesh, every "
            "service under its own `aimesh up --only NAME`, two decode replicas, fault proxies "
            "(`loadtest/faults.py`) on agent -> tools and tools -> retrieval. Numbers are for "
            f"this machine ({cores} cores, {memory:.0f} GiB, shared with other work): the "
            "recovery times are mostly model loading and would be far shorter on a larger "
            "machine; the counts depend on how many requests fit in each window.",
            "",
            "Sent, ok and failed count the load requests (a few concurrent clients per "
            "scenario, each request with a deadline: Generate 20 s, agent Run 30 s, "
            "knowledge_search 10 s, Search and Upsert 5 s); TOOL_ERROR is a tool result with "
            "is_error. Hung: still running 2 s past its deadline. Recovery: from the fault's "
            "end (for a kill, the kill) until a probe sent then succeeded end to end. "
            "Restarted, ready: until the supervisor's new process answered readiness. After a "
            "kill the notes also say when the agent was whole again: a run on a calculation "
            "planned by the model, answered by the calculator tool and by the model, with no "
            "note of a failure (every breaker on that way closed again); the next scenario "
            "starts only then.",
            "",
            table(rows),
            "",
            "What each fault is:",
            "",
            FAULTS,
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", default="abcdefghij", help="e.g. a,c,g (default: all)")
    parser.add_argument(
        "--kill", default=",".join(PROBE), help="services scenario a kills, in order"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.replace(",", "") if s]
    unknown = set(scenarios) - {"a", "b", *SCENARIOS}
    kill = [name for name in args.kill.split(",") if name]
    if unknown or set(kill) - set(PROBE):
        parser.error(f"unknown scenarios or services: {sorted(unknown | (set(kill) - set(PROBE)))}")

    async def guarded() -> tuple[list[Row], Path]:
        # SIGTERM must reach the finally blocks that stop every process the suite started.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run("".join(scenarios), kill)

    rows, log_dir = asyncio.run(guarded())
    markdown = report(rows)
    print(markdown)
    print(f"service logs: {log_dir}")
    if args.out:
        write(markdown, args.out)
    hung, lost = sum(r.hung for r in rows), sum(r.lost or 0 for r in rows)
    outside = sum(r.failed_outside or 0 for r in rows)
    if hung or lost or outside:
        print(
            f"FAILED: {hung} requests hung past their deadline, {lost} acknowledged writes "
            f"lost, {outside} requests failed outside a store fault's window"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
