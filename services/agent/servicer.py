"""The agent's gRPC surface: validate a Run, adapt tools and generation to the plan/act
loop (services/agent/loop.py), and stream its events as RunResponses; each run has an
id, its events are stored as they go (services/agent/runs.py), and Attach, Cancel and
GetRun reach it by that id."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import asdict
from itertools import islice
from typing import Any

import grpc
from google.protobuf import json_format

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh import caller, deadline, request_id, tracing
from mesh.failures import InvalidInput
from mesh.server import MeshServer
from mesh.store_health import StoreHealth
from mesh.timing import stage
from mesh.validation import Violations
from services.agent import checkpoint, llm_planner, loop, metrics, session_pages
from services.agent.mcp_mounts import Mount, MountedTools
from services.agent.planner import Observation, Tool, ToolStep
from services.agent.run_store import Orphan, Turn, open_run_store
from services.agent.runs import LiveRun, Runs
from services.agent.settings import AgentSettings

log = logging.getLogger(__name__)

SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
TOOLS = tools_pb2.DESCRIPTOR.services_by_name["ToolsService"]
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
# As agent.proto says; a question too long for the model's context still gets an answer
# from the evidence (generation refuses the prompt and Final.notes says so).
MAX_QUESTION_BYTES = 8 * 1024
# Tool.name's rule (tools.proto).
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# ListTools serves far fewer tools than this.
MAX_ALLOWED_TOOLS = 64
# BadRequest travels in trailing metadata (8 KiB by default): report the first few.
MAX_ELEMENT_VIOLATIONS = 8
MAX_ITERATIONS = 25
MAX_ANSWER_TOKENS = 2048
RUN_ID = re.compile(r"[0-9a-f]{32}")
SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
SESSION_RULE = "must be 1 to 128 of [A-Za-z0-9_.:-]"
PLANNERS = {
    loop.Planner.MODEL: agent_pb2.PLANNER_LLM,
    loop.Planner.RULES: agent_pb2.PLANNER_FALLBACK,
}


def check_request(request: agent_pb2.RunRequest) -> None:
    """Refuses (InvalidInput, naming each bad field) what no run could serve, before any
    work: every limit here bounds what a caller can make the agent and the model do."""
    options, question = request.options, request.question
    violations = Violations()
    violations.check(bool(question.strip()), "question", "must not be empty")
    violations.max_length(question.encode(), "question", MAX_QUESTION_BYTES)
    violations.check(request_id.is_valid(request.request_id), "request_id", request_id.RULE)
    violations.check(
        not request.session_id or SESSION_ID.fullmatch(request.session_id) is not None,
        "session_id",
        SESSION_RULE,
    )
    if options.HasField("max_iterations"):
        violations.in_range(options.max_iterations, "options.max_iterations", 1, MAX_ITERATIONS)
    violations.in_range(options.max_new_tokens, "options.max_new_tokens", 0, MAX_ANSWER_TOKENS)
    violations.in_range(options.temperature, "options.temperature", 0, 2)
    names = options.allowed_tools
    violations.check(
        len(names) <= MAX_ALLOWED_TOOLS,
        "options.allowed_tools",
        f"must name at most {MAX_ALLOWED_TOOLS} tools, got {len(names)}",
    )
    examined = islice(names, MAX_ALLOWED_TOOLS)
    bad = (i for i, name in enumerate(examined) if not TOOL_NAME.fullmatch(name))
    for i in islice(bad, MAX_ELEMENT_VIOLATIONS):
        violations.add(f"options.allowed_tools[{i}]", "must be 1 to 64 of [A-Za-z0-9_.-]")
    violations.raise_if_any()


def question_of(
    request: agent_pb2.RunRequest, history: Sequence[tuple[str, str]] = ()
) -> loop.Question:
    """The checked request as the loop's Question (a max_iterations set is at least 1)."""
    options = request.options
    return loop.Question(
        text=request.question,
        allowed_tools=tuple(options.allowed_tools),
        max_iterations=options.max_iterations or loop.DEFAULT_ITERATIONS,
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        seed=options.seed if options.HasField("seed") else None,
        history=history,
    )


def as_written(value: Any) -> Any:
    """A JSON value from a protobuf Struct with its whole numbers integers again: a Struct
    carries every number as a double, and a schema's maxLength of 1000.0 is no JSON Schema
    integer to a grammar compiler."""
    if isinstance(value, dict):
        return {key: as_written(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_written(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


@contextmanager
def reported() -> Iterator[None]:
    """A failed call to the tools or the model raises loop.Unavailable, named by its status."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise loop.Unavailable(error.code().name, error.details() or "") from None


class MeshTools:
    """loop.Tools over the tools service; the caller's client travels with each call
    (mesh.caller), so the tools' per-client state is the caller's. Each call's
    idempotency key is its run and its content: a run resumed on another replica that
    calls a tool again gets the first call's result if that call completed."""

    def __init__(self, channel: grpc.aio.Channel, run_id: str) -> None:
        self.stub = tools_pb2_grpc.ToolsServiceStub(channel)
        self.run_id = run_id

    async def list(self, timeout_s: float) -> loop.Catalogue:
        with reported():
            listed = await self.stub.ListTools(tools_pb2.ListToolsRequest(), timeout=timeout_s)
        return loop.Catalogue(
            {
                tool.name: Tool(
                    tool.name,
                    tool.description,
                    as_written(json_format.MessageToDict(tool.input_schema)),
                )
                for tool in listed.tools
            }
        )

    async def call(self, step: ToolStep, timeout_s: float) -> Observation | None:
        request = tools_pb2.CallToolRequest(
            name=step.name, arguments=step.arguments, idempotency_key=self._key(step)
        )
        observation = None
        with reported(), deadline.budget(timeout_s):
            async for message in self.stub.CallTool(request):
                if message.HasField("result"):
                    result = message.result
                    text = "\n".join(c.text for c in result.content if c.HasField("text"))
                    structured = json_format.MessageToDict(result.structured_content)
                    observation = Observation(step, result.is_error, text, structured)
        return observation

    def _key(self, step: ToolStep) -> str:
        return f"{self.run_id}:{hashlib.sha256(step.key().encode()).hexdigest()[:32]}"


class MeshGeneration:
    """loop.Generation over the generation service's Chat, for one request id. Tools are
    offered with their input schemas, tool choice auto (the model may answer instead) and
    parallel calls; the calls come whole with the stream's end."""

    def __init__(self, channel: grpc.aio.Channel, request_id: str) -> None:
        self.stub = generation_pb2_grpc.GenerationServiceStub(channel)
        self.request_id = request_id

    async def generate(
        self, messages: list[dict[str, Any]], sampling: loop.Sampling, timeout_s: float
    ) -> AsyncIterator[str | llm_planner.ModelCall | loop.Usage]:
        # None leaves an optional field (seed, max_new_tokens) unset: the model's default.
        parameters = sampling_pb2.SamplingParameters(
            temperature=sampling.temperature, seed=sampling.seed
        )
        if sampling.repetition_penalty is not None:
            parameters.repetition_penalty = sampling.repetition_penalty
        request = generation_pb2.ChatRequest(
            model=sampling.model,
            request_id=self.request_id,
            messages=messages,
            sampling=parameters,
            stopping=sampling_pb2.StoppingCriteria(max_new_tokens=sampling.max_new_tokens),
            tools=[
                generation_pb2.ToolDefinition(
                    name=tool.name,
                    description=tool.description,
                    parameters=json.dumps(tool.input_schema),
                )
                for tool in sampling.tools
            ],
        )
        if sampling.tools:
            request.tool_choice.mode = generation_pb2.ToolChoice.MODE_AUTO
            request.parallel_tool_calls = True
        with reported():
            # The budget applies to the call as it starts; the stream is read outside it.
            with deadline.budget(timeout_s):
                chat = self.stub.Chat(request)
            try:
                async for message in chat:
                    if message.HasField("chunk"):
                        yield message.chunk.text
                    else:
                        for call in message.complete.tool_calls:
                            yield llm_planner.ModelCall(call.id, call.name, call.arguments)
                        usage = message.complete.usage
                        yield loop.Usage(
                            usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
                        )
            finally:
                chat.cancel()


def response(event: loop.Event) -> agent_pb2.RunResponse:
    """The RunResponse that reports one of the loop's events."""
    if isinstance(event, loop.Planned):
        plan = agent_pb2.Plan(planner=PLANNERS[event.planner], steps=event.steps)
        return agent_pb2.RunResponse(plan=plan)
    if isinstance(event, loop.Calling):
        step = event.step
        call = agent_pb2.ToolCall(call_id=event.call_id, name=step.name, arguments=step.arguments)
        return agent_pb2.RunResponse(tool_call=call)
    if isinstance(event, loop.Called):
        observation = event.observation
        result = agent_pb2.ToolResult(
            call_id=event.call_id,
            name=observation.step.name,
            is_error=observation.is_error,
            summary=observation.text[:200],
            structured=observation.structured,
            duration_ns=int(event.seconds * 1e9),
        )
        return agent_pb2.RunResponse(tool_result=result)
    if isinstance(event, loop.Answered):
        return agent_pb2.RunResponse(answer_delta=agent_pb2.AnswerDelta(text=event.text))
    return agent_pb2.RunResponse(citations=agent_pb2.Citations(passage_ids=event.passage_ids))


def final(state: loop.RunState, ended: int) -> agent_pb2.Final:
    compute, call = common_pb2.STAGE_KIND_COMPUTE, common_pb2.STAGE_KIND_CALL
    stages = [
        stage(hop.name, hop.seconds, compute if hop.service == "agent" else call, hop.service)
        for hop in state.hops
    ]
    return agent_pb2.Final(
        usage=common_pb2.Usage(**asdict(state.usage)),
        timing=common_pb2.Timing(stages=stages, total_ns=int(state.elapsed_s() * 1e9)),
        iterations=state.iterations,
        trace_id=tracing.current_trace_id(),
        planner=PLANNERS[state.planner],
        notes=state.notes,
        state=ended,
    )


def fit_history(turns: list[Turn], chars: int) -> tuple[list[tuple[str, str]], int]:
    """The newest turns whose questions and answers fit in `chars`, oldest first, and
    how many older ones were left out."""
    kept: list[tuple[str, str]] = []
    used = 0
    for turn in reversed(turns):
        used += len(turn.question) + len(turn.answer)
        if used > chars:
            break
        kept.append((turn.question, turn.answer))
    return kept[::-1], len(turns) - len(kept)


def _ended(state: loop.RunState) -> tuple[int, str]:
    """The terminal state of a run the loop finished, and its reason label."""
    if state.handed_off:
        return agent_pb2.RUN_STATE_HANDED_OFF, state.handed_off
    if state.partial:
        return agent_pb2.RUN_STATE_PARTIAL, state.shortfalls[0]
    return agent_pb2.RUN_STATE_ANSWERED, ""


def check_session_id(session_id: str) -> None:
    violations = Violations()
    violations.check(SESSION_ID.fullmatch(session_id) is not None, "session_id", SESSION_RULE)
    violations.raise_if_any()


def check_run_id(run_id: str) -> None:
    violations = Violations()
    violations.check(
        RUN_ID.fullmatch(run_id) is not None, "run_id", "must be a run id (32 hex digits)"
    )
    violations.raise_if_any()


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(
        self, server: MeshServer, settings: AgentSettings, runs: Runs, mounts: Sequence[Mount]
    ) -> None:
        self.server = server
        self.settings = settings
        self.runs = runs
        self.mounts = mounts

    async def _history(self, client: str, session_id: str) -> tuple[list[tuple[str, str]], int]:
        if not session_id:
            return [], 0
        turns = await self.runs.stored(self.runs.store.turns, client, session_id)
        return fit_history(turns, self.settings.history_chars)

    async def Run(
        self, request: agent_pb2.RunRequest, context: grpc.aio.ServicerContext | None
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        check_request(request)
        client = caller.current()
        history, left_out = await self._history(client, request.session_id)
        state = loop.RunState()
        if left_out:
            state.notes.append(
                f"{left_out} earlier turn(s) of the session left out of the prompt (history_chars)"
            )
        question, left_s = question_of(request, history), deadline.remaining()
        run = await self.runs.start(
            request, client, lambda live: self._execute(live, request, question, state, left_s)
        )
        try:
            async for event in run.follow(0):
                if event.HasField("final") and isinstance(run.error, InvalidInput):
                    raise run.error  # refused once the tools were known: the caller's error
                yield event
            if run.error is not None and not isinstance(run.error, InvalidInput):
                raise run.error
        finally:
            if not request.options.background:
                # However this call ends (the caller left, its deadline), so does the run.
                await run.stop()

    async def resume(self, orphan: Orphan) -> None:
        """Goes on with a run whose replica died, from its last checkpoint: completed
        tool calls are not made again, and the answer already sent is not sent again."""
        request = orphan.request
        try:
            state = checkpoint.load(orphan.checkpoint) if orphan.checkpoint else loop.RunState()
        except ValueError as error:
            log.warning("checkpoint unreadable; the run starts over", extra={"error": str(error)})
            state = loop.RunState()
        state.notes.append("resumed on another replica after the first stopped")
        metrics.RESUMED.inc()
        history, _ = await self._history(orphan.client, request.session_id)
        question = question_of(request, history)
        await self.runs.adopt(
            orphan,
            lambda live: self._execute(live, request, question, state, None, orphan.answer),
        )

    async def _execute(
        self,
        run: LiveRun,
        request: agent_pb2.RunRequest,
        question: loop.Question,
        state: loop.RunState,
        left_s: float | None,
        sent: str = "",
    ) -> None:
        """The run, every event stored and published, the loop's state checkpointed
        after each plan and tool result; it always ends with a Final that says how it
        ended. `sent`: the answer a resumed run had already sent, not sent again."""
        caller.act_for(run.client)
        runner = loop.Loop(
            MountedTools(
                MeshTools(self.server.channel_to("tools", TOOLS), run.run_id), self.mounts
            ),
            MeshGeneration(self.server.channel_to("generation", GENERATION), request.request_id),
            self.settings,
        )
        answer = ""  # this replica's answer, of which `sent` may be the start
        try:
            # aclosing: however this run ends (Cancel, its caller leaving, an error), the
            # loop is closed here and now, and with it the calls it has in flight.
            async with aclosing(runner.run(question, left_s, state)) as events:
                async for event in events:
                    if isinstance(event, loop.Answered):
                        before, answer = len(answer), answer + event.text
                        if len(answer) <= len(sent):
                            continue
                        event = loop.Answered(answer[max(before, len(sent)) :])
                    # The state is small (bounded by max_iterations); dumped here, as the
                    # loop changes it between steps.
                    saved = None
                    if isinstance(event, (loop.Planned, loop.Called)):
                        saved = checkpoint.dump(state)
                        metrics.CHECKPOINT_BYTES.observe(len(saved))
                    await self.runs.emit(run, response(event), checkpoint=saved)
            if not answer.startswith(sent):
                state.fell_short(
                    "resume_mismatch", "the answer made after the resume differs from the part sent"
                )
            ended, reason = _ended(state)
            if state.handed_off:
                await self.runs.stored(
                    self.runs.store.hand_off,
                    run.run_id,
                    run.client,
                    request,
                    state.notes,
                    write=True,
                )
        except asyncio.CancelledError:
            state.notes.append("cancelled")
            ended, reason = agent_pb2.RUN_STATE_CANCELLED, ""
        except Exception as error:
            invalid = isinstance(error, InvalidInput)
            if not invalid:
                log.exception("agent run failed", extra={"run_id": run.run_id})
            run.error = error
            state.notes.append(f"failed: {error}")
            ended, reason = agent_pb2.RUN_STATE_FAILED, "invalid_input" if invalid else "error"
        await self.runs.emit(run, agent_pb2.RunResponse(final=final(state, ended)), ended)
        name = agent_pb2.RunState.Name(ended).removeprefix("RUN_STATE_").lower()
        metrics.RUNS.labels(name, reason).inc()

    async def Attach(
        self, request: agent_pb2.AttachRequest, context: grpc.aio.ServicerContext | None
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        check_run_id(request.run_id)
        following = self.runs.follow(request.run_id, caller.current(), request.after_seq)
        async with aclosing(following) as events:
            async for event in events:
                yield event

    async def Cancel(
        self, request: agent_pb2.CancelRequest, context: grpc.aio.ServicerContext | None
    ) -> agent_pb2.CancelResponse:
        check_run_id(request.run_id)
        ended = await self.runs.cancel(request.run_id, caller.current())
        return agent_pb2.CancelResponse(state=ended)

    async def GetSession(
        self, request: agent_pb2.GetSessionRequest, context: grpc.aio.ServicerContext | None
    ) -> agent_pb2.GetSessionResponse:
        """A page of the session's turns (services/agent/session_pages.py)."""
        check_session_id(request.session_id)
        violations = Violations()
        size, after = session_pages.checked(request, violations)
        violations.raise_if_any()
        store = self.runs.store
        # One more than the page holds: whether another page follows.
        turns = await self.runs.stored(
            store.turns, caller.current(), request.session_id, after, size + 1
        )
        return session_pages.page(turns, size)

    async def DeleteSession(
        self, request: agent_pb2.DeleteSessionRequest, context: grpc.aio.ServicerContext | None
    ) -> agent_pb2.DeleteSessionResponse:
        check_session_id(request.session_id)
        deleted = await self.runs.stored(
            self.runs.store.delete_session, caller.current(), request.session_id, write=True
        )
        return agent_pb2.DeleteSessionResponse(deleted_runs=deleted)

    async def GetRun(
        self, request: agent_pb2.GetRunRequest, context: grpc.aio.ServicerContext | None
    ) -> agent_pb2.GetRunResponse:
        check_run_id(request.run_id)
        record = await self.runs.record(request.run_id, caller.current())
        return agent_pb2.GetRunResponse(
            run_id=record.run_id,
            state=record.state,
            question=record.question,
            events=record.events,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )


def serve_agent(server: MeshServer, settings: AgentSettings) -> AgentServicer:
    """The agent on the run store the settings name (default: a SQLite file in the
    cache; a Redis URL for replicas on several machines), its runs' upkeep (cancels,
    leases, taking over a dead replica's runs) running once the server starts, and every
    run here stopped when it shuts down."""
    store = open_run_store(settings.run_store, server.settings.cache_dir, settings.run_retention_s)
    health = StoreHealth("run_store", health=server.health, service=server.name)
    runs = Runs(store, settings.max_live_runs, settings.attach_poll_s, settings.lease_s, health)
    mounts = [
        Mount(mcp, server.settings.client.breaker, server.health, server.name)
        for mcp in settings.mcp_servers
    ]
    server.info.external_servers.extend(mount.info for mount in mounts)
    servicer = AgentServicer(server, settings, runs, mounts)

    async def keep_up() -> None:
        server.watch(asyncio.create_task(runs.upkeep(servicer.resume), name="agent-run-upkeep"))
        for mount in mounts:  # each reconnects on its own: its failures are not the process's
            mount.start()

    async def close() -> None:
        await runs.close()
        for mount in mounts:
            await mount.stop()
        store.close()

    server.add_warmup(keep_up)
    server.add_shutdown(close)
    return servicer


async def setup(server: MeshServer) -> None:
    servicer = serve_agent(server, server.options_as(AgentSettings))
    server.add_service(agent_pb2_grpc.add_AgentServiceServicer_to_server, servicer, SERVICE)
