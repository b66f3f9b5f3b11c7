"""The agent's gRPC surface: validate, then plan -> call tools in parallel -> answer.

Deadline split: the run's budget (its own deadline, or default_budget_s) is cut in two;
tools get what is left after keeping answer_share of it (at least answer_min_s) for the
answer, so slow or stuck tools cost the answer its evidence, never its existence. When
generation itself fails, the agent answers from the evidence directly.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from itertools import islice

import grpc
from google.protobuf import json_format

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh import deadline, request_id, tracing
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.agent import llm_planner, planner, prompts
from services.agent.settings import AgentSettings, agent_settings, dependency_targets

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
DEFAULT_ITERATIONS = 4
MAX_ANSWER_TOKENS = 2048
# Below this, a model call for the plan would leave the tools nothing; rules are instant.
MIN_PLAN_S = 0.5


def event(**kind: object) -> agent_pb2.RunResponse:
    return agent_pb2.RunResponse(**kind)


def check_request(request: agent_pb2.RunRequest) -> None:
    """Refuses (InvalidInput, naming each bad field) what no run could serve, before any
    work: every limit here bounds what a caller can make the agent and the model do."""
    options, question = request.options, request.question
    violations = Violations()
    violations.check(bool(question.strip()), "question", "must not be empty")
    violations.max_length(question.encode(), "question", MAX_QUESTION_BYTES)
    violations.check(request_id.is_valid(request.request_id), "request_id", request_id.RULE)
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


def allowed_tools(options: agent_pb2.RunOptions, available: Mapping[str, str]) -> dict[str, str]:
    """The tools a run may call (name -> description): those it names, all when it names
    none. Naming a tool ListTools does not know is InvalidInput on options.allowed_tools."""
    unknown = list(dict.fromkeys(n for n in options.allowed_tools if n not in available))
    if unknown:
        shown = ", ".join(unknown[:MAX_ELEMENT_VIOLATIONS])
        violations = Violations()
        violations.add(
            "options.allowed_tools", f"unknown tools {shown}; known: {', '.join(sorted(available))}"
        )
        violations.raise_if_any()
    chosen = set(options.allowed_tools)
    return {name: text for name, text in available.items() if not chosen or name in chosen}


@dataclass
class RunState:
    """What one run has gathered so far; Final is made from it."""

    received: float
    observations: list[planner.Observation] = field(default_factory=list)
    stages: list[common_pb2.Stage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    planners: set[int] = field(default_factory=set)
    iterations: int = 0
    answer: str = ""
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)

    def final(self) -> agent_pb2.Final:
        return agent_pb2.Final(
            usage=self.usage,
            timing=common_pb2.Timing(
                stages=self.stages, total_ns=int((time.monotonic() - self.received) * 1e9)
            ),
            iterations=self.iterations,
            trace_id=tracing.current_trace_id(),
            # FALLBACK when any iteration was planned by the rules.
            planner=(
                agent_pb2.PLANNER_FALLBACK
                if agent_pb2.PLANNER_FALLBACK in self.planners
                else agent_pb2.PLANNER_LLM
            ),
            notes=self.notes,
        )


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, server: MeshServer, settings: AgentSettings) -> None:
        self.settings = settings
        self.channels = server.channels
        self.tools_target, self.generation_target = dependency_targets(server.settings, settings)

    def _tools(self) -> tools_pb2_grpc.ToolsServiceStub:
        return tools_pb2_grpc.ToolsServiceStub(self.channels.get(self.tools_target, TOOLS))

    def _generation(self) -> generation_pb2_grpc.GenerationServiceStub:
        return generation_pb2_grpc.GenerationServiceStub(
            self.channels.get(self.generation_target, GENERATION)
        )

    async def _tool_descriptions(self) -> dict[str, str] | None:
        try:
            listed = await self._tools().ListTools(tools_pb2.ListToolsRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return None
        return {tool.name: tool.description for tool in listed.tools}

    async def _plan(
        self,
        request: agent_pb2.RunRequest,
        allowed: dict[str, str],
        observations: list[planner.Observation],
        notes: list[str],
        window_s: float,
    ) -> tuple[list[planner.ToolStep], int]:
        """The model picks the first tool; follow-ups, and any plan the model cannot make
        usable, are the rules'. The model may use half of what is left for tools (at most
        plan_timeout_s); with too little for that, the rules plan at once. Returns the
        steps and which planner made them. Planning runs in a worker thread: it is cheap
        but not free (a few calculator checks), and the event loop serves every caller."""
        question = request.question
        rules = await asyncio.to_thread(planner.plan, question, set(allowed), observations)
        if observations or not allowed:
            return rules, agent_pb2.PLANNER_FALLBACK
        plan_s = min(self.settings.plan_timeout_s, window_s / 2)
        if plan_s < MIN_PLAN_S:
            notes.append("too little time to ask the model for a plan; planned by rules")
            return rules, agent_pb2.PLANNER_FALLBACK
        try:
            with deadline.budget(plan_s):
                choice = await llm_planner.choose(
                    self._generation(), question, allowed, request.request_id
                )
        except grpc.aio.AioRpcError as error:
            notes.append(f"the planning model failed ({error.code().name}); planned by rules")
            return rules, agent_pb2.PLANNER_FALLBACK
        if choice == llm_planner.ANSWER:
            return [], agent_pb2.PLANNER_LLM
        if choice not in allowed:
            notes.append(f"the model chose {choice[:64]!r}, not a tool of this run")
            return rules, agent_pb2.PLANNER_FALLBACK
        step = await asyncio.to_thread(llm_planner.step_for, choice, question)
        if step is None:
            notes.append(f"the model chose {choice}, but the question gives it no arguments")
            return rules, agent_pb2.PLANNER_FALLBACK
        # Calls the rules find for other tools are independent of the model's pick.
        return [step, *(s for s in rules if s.name != step.name)], agent_pb2.PLANNER_LLM

    async def _allowed_tools(self, request: agent_pb2.RunRequest, run: RunState) -> dict[str, str]:
        """Validates the request; the tools this run may call, name -> description."""
        check_request(request)
        available = await self._tool_descriptions()
        if available is None:
            run.notes.append("the tools service was unavailable; answered without tools")
            return {}
        return allowed_tools(request.options, available)

    async def Run(
        self, request: agent_pb2.RunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        run = RunState(received=time.monotonic())
        allowed = await self._allowed_tools(request, run)
        left_s = deadline.remaining()
        budget_s = (
            self.settings.default_budget_s if left_s is None else left_s
        ) - self.settings.wrap_up_s
        reserve_s = max(budget_s * self.settings.answer_share, self.settings.answer_min_s)
        tools_until = run.received + budget_s - reserve_s
        # aclosing: however this run ends (client cancel, deadline, error), each stage is
        # closed here and now, and with it the calls it has in flight.
        with deadline.budget(budget_s):
            async with aclosing(self._act(request, allowed, run, tools_until)) as acting:
                async for message in acting:
                    yield message
            async with aclosing(self._respond(request, run)) as responding:
                async for message in responding:
                    yield message
        citations = prompts.cited(run.answer, run.observations, self.settings.passages_in_prompt)
        if citations:
            yield event(citations=agent_pb2.Citations(passage_ids=citations))
        yield event(final=run.final())

    async def _act(
        self,
        request: agent_pb2.RunRequest,
        allowed: dict[str, str],
        run: RunState,
        tools_until: float,
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        """Plan -> call tools, until the plan is empty, max_iterations, or the tools' time
        is spent."""
        options = request.options
        max_iterations = (
            options.max_iterations if options.HasField("max_iterations") else DEFAULT_ITERATIONS
        )
        while True:
            planned = time.monotonic()
            steps, made_by = await self._plan(
                request, allowed, run.observations, run.notes, tools_until - planned
            )
            if steps or not run.observations:
                run.planners.add(made_by)
            run.stages.append(
                stage("plan", time.monotonic() - planned, common_pb2.STAGE_KIND_COMPUTE, "agent")
            )
            if not steps:
                if not run.observations:
                    answer_only = agent_pb2.Plan(planner=made_by, steps=["answer without tools"])
                    yield event(plan=answer_only)
                return
            if run.iterations == max_iterations:
                run.notes.append(
                    f"stopped at max_iterations ({max_iterations}) with tools still to call"
                )
                return
            left = tools_until - time.monotonic()
            if left <= 0:
                run.notes.append("no time was left for more tool calls")
                return
            run.iterations += 1
            yield event(plan=agent_pb2.Plan(planner=made_by, steps=[s.why for s in steps]))
            calls = self._call_all(steps, run.iterations, left, run)
            async with aclosing(calls) as calling:
                async for message in calling:
                    yield message

    async def _respond(
        self, request: agent_pb2.RunRequest, run: RunState
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        """Streams the model's answer; if the model fails, the evidence itself."""
        answered = time.monotonic()
        try:
            async with aclosing(self._answer(request, run.observations)) as answer:
                async for chunk, complete in answer:
                    if chunk:
                        run.answer += chunk
                        yield event(answer_delta=agent_pb2.AnswerDelta(text=chunk))
                    if complete is not None:
                        run.usage = complete.usage
        except grpc.aio.AioRpcError as error:
            run.notes.append(
                f"the language model failed ({error.code().name}); answered from the evidence"
            )
            fallback = prompts.fallback_answer(run.observations)
            run.answer += ("\n\n" if run.answer else "") + fallback
            yield event(answer_delta=agent_pb2.AnswerDelta(text=fallback))
        run.stages.append(
            stage("answer", time.monotonic() - answered, common_pb2.STAGE_KIND_CALL, "generation")
        )

    async def _call_all(
        self, steps: list[planner.ToolStep], iteration: int, left_s: float, run: RunState
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        """Announces every call, runs them at once within `left_s`, reports each as it ends.
        Calls still running when this ends early are cancelled and awaited, so none
        outlives the run."""
        calls = {f"{iteration}.{k}": step for k, step in enumerate(steps, start=1)}
        for call_id, step in calls.items():
            yield event(
                tool_call=agent_pb2.ToolCall(
                    call_id=call_id, name=step.name, arguments=step.arguments
                )
            )
        with deadline.budget(left_s):
            tasks = [
                asyncio.create_task(self._call(call_id, step)) for call_id, step in calls.items()
            ]
        try:
            for finished in asyncio.as_completed(tasks):
                call_id, observation, seconds = await finished
                run.observations.append(observation)
                run.stages.append(
                    stage(observation.step.name, seconds, common_pb2.STAGE_KIND_CALL, "tools")
                )
                if observation.is_error:
                    run.notes.append(f"{observation.step.name}: {observation.text}")
                yield event(
                    tool_result=agent_pb2.ToolResult(
                        call_id=call_id,
                        name=observation.step.name,
                        is_error=observation.is_error,
                        summary=observation.text[:200],
                        structured=observation.structured,
                        duration_ns=int(seconds * 1e9),
                    )
                )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _call(
        self, call_id: str, step: planner.ToolStep
    ) -> tuple[str, planner.Observation, float]:
        started = time.monotonic()
        request = tools_pb2.CallToolRequest(name=step.name, arguments=step.arguments)
        observation = planner.Observation(step, True, "the tool ended without a result")
        try:
            async for message in self._tools().CallTool(request):
                if message.HasField("result"):
                    result = message.result
                    text = "\n".join(c.text for c in result.content if c.HasField("text"))
                    structured = json_format.MessageToDict(result.structured_content)
                    observation = planner.Observation(step, result.is_error, text, structured)
        except grpc.aio.AioRpcError as error:
            observation = planner.Observation(
                step, True, f"the call failed ({error.code().name}): {error.details()}"
            )
        return call_id, observation, time.monotonic() - started

    async def _answer(
        self, request: agent_pb2.RunRequest, observations: list[planner.Observation]
    ) -> AsyncIterator[tuple[str, generation_pb2.GenerationComplete | None]]:
        options = request.options
        sampling = sampling_pb2.SamplingParameters(
            temperature=options.temperature,
            repetition_penalty=self.settings.repetition_penalty,
        )
        if options.HasField("seed"):
            sampling.seed = options.seed
        stopping = sampling_pb2.StoppingCriteria(
            max_new_tokens=options.max_new_tokens or self.settings.max_new_tokens
        )
        messages = prompts.answer_messages(
            request.question, observations, self.settings.passages_in_prompt
        )
        stub = self._generation()
        chat = generation_pb2.ChatRequest(
            request_id=request.request_id, messages=messages, sampling=sampling, stopping=stopping
        )
        async for message in stub.Chat(chat):
            if message.HasField("chunk"):
                yield message.chunk.text, None
            else:
                yield "", message.complete


async def setup(server: MeshServer) -> None:
    servicer = AgentServicer(server, agent_settings(server.settings))
    server.add_service(agent_pb2_grpc.add_AgentServiceServicer_to_server, servicer, SERVICE)
