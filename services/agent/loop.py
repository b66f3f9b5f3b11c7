"""The agent's plan/act loop: plan -> call tools in parallel -> ... -> answer, in a budget.

Plain async code over three small interfaces (list the tools, call one, generate text),
so it runs without grpc: the servicer adapts the mesh's stubs to them, tests fakes.

Deadline split: the run's budget (its own deadline, or default_budget_s) is cut in two;
tools get what is left after keeping answer_share of it (at least answer_min_s) for the
answer, so slow or stuck tools cost the answer its evidence, never its existence. When
generation itself fails, the agent answers from the evidence directly. Every failure
becomes a note (RunState.notes) saying what the run could not do.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mesh.failures import FieldViolation, InvalidInput
from services.agent import llm_planner, planner, prompts
from services.agent.planner import Observation, Tool, ToolStep
from services.agent.settings import AgentSettings

DEFAULT_ITERATIONS = 4
# Below this, a model call for the plan would leave the tools nothing; rules are instant.
MIN_PLAN_S = 0.5
# A plan's tokens: a question-long search, or a calculation and a lookup at once, fit; a
# model that rambles in an argument is cut short, and a call cut short is unusable.
PLAN_TOKENS = 64
# ListTools answers from memory: a tools service slower than this counts as down.
LIST_TOOLS_S = 5.0
# An unknown-tools error names at most this many.
MAX_NAMED = 8
# Iterations (and failed calls) with no call succeeding after which a run goes to a person.
REPEATED_FAILURES = 2


class Unavailable(Exception):
    """A call to the tools or the model failed; `reason` says how (e.g. a status name)."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(f"{reason}: {details}" if details else reason)
        self.reason = reason
        self.details = details


@dataclass(frozen=True)
class Sampling:
    """How the model generates; None leaves a setting to the model's default."""

    temperature: float = 0.0
    seed: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    # Tools the model may call instead of answering (tool choice auto, several calls at
    # once); empty: it answers.
    tools: tuple[Tool, ...] = ()
    # Which registered model answers (its version picked by the router); "": the mesh's own.
    model: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class Catalogue:
    """The tools a run can call, by name, and notes on what could not be listed (a
    mounted MCP server down, a tool of it skipped)."""

    tools: dict[str, Tool]
    notes: tuple[str, ...] = ()


class Tools(Protocol):
    async def list(self, timeout_s: float) -> Catalogue:
        """Every tool the run can call. Raises Unavailable when there are none to list."""

    async def call(self, step: ToolStep, timeout_s: float) -> Observation | None:
        """The call's result (is_error when the tool failed); None when the call ended
        without one. Raises Unavailable when the call itself failed."""


class Generation(Protocol):
    def generate(
        self, messages: list[dict[str, Any]], sampling: Sampling, timeout_s: float
    ) -> AsyncIterator[str | llm_planner.ModelCall | Usage]:
        """The model's reply within timeout_s: its answer as text chunks, then the tool
        calls it made (with sampling.tools), then its Usage. `messages` are chat turns as
        dicts of ChatMessage's fields (an assistant's tool_calls, a tool turn's
        tool_call_id). Raises Unavailable."""


class Planner(enum.Enum):
    MODEL = "model"
    RULES = "rules"


@dataclass(frozen=True)
class Question:
    """One run's request, validated."""

    text: str
    # Tool names the run may call; empty: every tool.
    allowed_tools: Sequence[str] = ()
    max_iterations: int = DEFAULT_ITERATIONS
    # For the answer; 0: AgentSettings.max_new_tokens.
    max_new_tokens: int = 0
    temperature: float = 0.0
    seed: int | None = None
    # The session's earlier (question, answer) turns, oldest first, already within budget.
    history: Sequence[tuple[str, str]] = ()


# What a run reports as it goes, in this order: per iteration a Plan, then a Calling per
# call and a Called as each ends; then the answer's text; then its citations, if any.
@dataclass(frozen=True)
class Planned:
    planner: Planner
    steps: list[str]


@dataclass(frozen=True)
class Calling:
    call_id: str
    step: ToolStep


@dataclass(frozen=True)
class Called:
    call_id: str
    observation: Observation
    seconds: float


@dataclass(frozen=True)
class Answered:
    text: str


@dataclass(frozen=True)
class Cited:
    passage_ids: list[str]


Event = Planned | Calling | Called | Answered | Cited


@dataclass(frozen=True)
class Hop:
    """A stage of the run: `service` is "agent" for work done here, else the one called."""

    name: str
    seconds: float
    service: str


@dataclass
class RunState:
    """What one run has gathered so far; its summary (Final) is made from it."""

    started: float = field(default_factory=time.monotonic)
    observations: list[Observation] = field(default_factory=list)
    hops: list[Hop] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # RULES once any iteration was planned by the rules.
    planner: Planner = Planner.MODEL
    iterations: int = 0
    answer: str = ""
    usage: Usage = field(default_factory=Usage)
    # Why the answer lacks something the run set out to use (a tool, the model,
    # iterations or time), first reason first: its terminal state is PARTIAL, not ANSWERED.
    shortfalls: list[str] = field(default_factory=list)
    # Why the run went to a person instead of answering (max_iterations, tool_failures);
    # "" while it answers itself.
    handed_off: str = ""

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def partial(self) -> bool:
        return bool(self.shortfalls)

    def fell_short(self, reason: str, note: str) -> None:
        """A note that says the answer lacks something, and why in one word (a metric
        label: tools_unavailable, max_iterations, deadline, tool_failed, model_failed,
        resume_mismatch)."""
        self.notes.append(note)
        self.shortfalls.append(reason)


def hand_off_reason(state: RunState) -> tuple[str, str]:
    """Why the run should go to a person rather than answer: it has nothing to answer
    from (no tool call succeeded) after max_iterations, or after tool calls failed in
    more than one iteration (one failing round still answers, from what it has); ""
    when it can answer (a question that needed no tool answers from the model). As
    (a metric label, a note)."""
    if any(not o.is_error for o in state.observations):
        return "", ""
    if "max_iterations" in state.shortfalls:
        return "max_iterations", "max_iterations reached and no tool call succeeded"
    failed = sum(o.is_error for o in state.observations)
    if state.iterations >= REPEATED_FAILURES and failed >= REPEATED_FAILURES:
        note = f"{failed} tool calls over {state.iterations} iterations failed, none succeeded"
        return "tool_failures", note
    return "", ""


def select_tools(names: Sequence[str], available: Mapping[str, Tool]) -> dict[str, Tool]:
    """The tools a run may call: those it names, all when it names none. Naming a tool
    the tools service does not serve is InvalidInput on options.allowed_tools."""
    unknown = list(dict.fromkeys(n for n in names if n not in available))
    if unknown:
        shown, known = ", ".join(unknown[:MAX_NAMED]), ", ".join(sorted(available))
        refusal = FieldViolation("options.allowed_tools", f"unknown tools {shown}; known: {known}")
        raise InvalidInput([refusal])
    chosen = set(names)
    return {name: tool for name, tool in available.items() if not chosen or name in chosen}


class Loop:
    """Runs questions against one tools service and one model."""

    def __init__(self, tools: Tools, generation: Generation, settings: AgentSettings) -> None:
        self.tools = tools
        self.generation = generation
        self.settings = settings

    async def run(
        self, question: Question, left_s: float | None, state: RunState
    ) -> AsyncIterator[Event]:
        """Events of one run with `left_s` to go (None: default_budget_s) counted from
        state.started; what it gathered stays in `state`. Closing it early (the caller
        went away) cancels and awaits every call in flight."""
        settings = self.settings
        budget_s = (settings.default_budget_s if left_s is None else left_s) - settings.wrap_up_s
        reserve_s = max(budget_s * settings.answer_share, settings.answer_min_s)
        tools_until = state.started + budget_s - reserve_s
        tools = await self._tools(question, state, budget_s)
        async with aclosing(self._act(question, tools, state, tools_until)) as acting:
            async for event in acting:
                yield event
        reason, why = hand_off_reason(state)
        if reason:
            # A guess from nothing helps no one: a person takes it (the servicer's sink).
            state.handed_off = reason
            state.notes.append(f"handed off to a person: {why}")
            return
        async with aclosing(self._respond(question, state, state.started + budget_s)) as answer:
            async for event in answer:
                yield event
        citations = prompts.cited(state.answer, state.observations, settings.passages_in_prompt)
        if citations:
            yield Cited(citations)

    async def _tools(self, question: Question, state: RunState, budget_s: float) -> dict[str, Tool]:
        """The tools this run may call, with their schemas; none when they cannot be
        listed, and a note says so."""
        timeout_s = max(min(LIST_TOOLS_S, budget_s), 0)
        try:
            async with asyncio.timeout(timeout_s):
                available = await self.tools.list(timeout_s)
        except (Unavailable, TimeoutError):
            state.fell_short(
                "tools_unavailable", "the tools service was unavailable; answered without tools"
            )
            return {}
        state.notes.extend(available.notes)
        return select_tools(question.allowed_tools, available.tools)

    async def _plan(
        self, question: Question, tools: dict[str, Tool], state: RunState, window_s: float
    ) -> tuple[list[ToolStep], Planner]:
        """Each round, the model plans with tool calls (llm_planner), seeing the session,
        the question and the rounds so far; it may answer instead, which ends the calls.
        Calls already made are not made again (their results are in its conversation).
        The rules plan, with a note, when the model cannot (too little time, a failure, a
        timeout), when none of its calls is usable, and when it stops while no call has
        succeeded (an answer from nothing helps no one); once they have planned, they
        plan the run's later rounds too. The model may use half of what is left for
        tools, at most plan_timeout_s."""
        if not tools:
            return [], Planner.RULES
        if state.planner is Planner.RULES and state.observations:
            # The model could not plan an earlier round: the rules go on, rather than spend
            # the run's time asking it again.
            return await self._by_rules(question, tools, state, "the model could not plan")
        plan_s = min(self.settings.plan_timeout_s, window_s / 2)
        if plan_s < MIN_PLAN_S:
            return await self._by_rules(
                question, tools, state, "too little time to ask the model for a plan"
            )
        conversation, shown = llm_planner.messages(
            question.text, tools, question.history, state.observations
        )
        try:
            async with asyncio.timeout(plan_s):
                calls = await self._calls(conversation, tools, plan_s)
        except (TimeoutError, Unavailable) as error:
            reason = error.reason if isinstance(error, Unavailable) else "DEADLINE_EXCEEDED"
            return await self._by_rules(
                question, tools, state, f"the planning model failed ({reason})"
            )
        planned, unusable = llm_planner.steps(calls, tools, shown)
        state.notes.extend(unusable)
        made = {o.step.key() for o in state.observations}
        fresh = list({s.key(): s for s in planned if s.key() not in made}.values())
        if fresh:
            return fresh + await self._beside(question, tools, state, fresh), Planner.MODEL
        if unusable:
            return await self._by_rules(question, tools, state, "no call of the model's is usable")
        if state.observations and all(o.is_error for o in state.observations):
            return await self._by_rules(
                question, tools, state, "the model stopped with no call succeeded"
            )
        return [], Planner.MODEL

    async def _beside(
        self, question: Question, tools: dict[str, Tool], state: RunState, planned: list[ToolStep]
    ) -> list[ToolStep]:
        """In the first round, the rules' calls to tools the model did not call, noted: a
        small model calls one tool where a question needs two ("What is 6*7, and what does
        json.loads do?"), and independent calls cost nothing to run beside its own."""
        if state.observations:
            return []
        rules = await _rules(question, tools, [])
        called = {step.name for step in planned}
        added = [step for step in rules if step.name not in called]
        if added:
            names = ", ".join(step.name for step in added)
            state.notes.append(f"the rules added {names}, which the model did not call")
        return added

    async def _by_rules(
        self, question: Question, tools: dict[str, Tool], state: RunState, why: str
    ) -> tuple[list[ToolStep], Planner]:
        """The rules' plan, noted as `why` when they plan calls or the run's first round
        (a follow-up with nothing to call just answers)."""
        seen = state.observations
        rules = await _rules(question, tools, seen)
        if rules or not seen:
            state.notes.append(f"{why}; planned by rules")
        return rules, Planner.RULES

    async def _calls(
        self, messages: list[dict[str, Any]], tools: dict[str, Tool], timeout_s: float
    ) -> list[llm_planner.ModelCall]:
        """The model's calls; none when it answers instead. Its answer is not read on (the
        run's answer comes from the answer prompt, with the evidence): the stream is
        closed at the answer's first text."""
        sampling = Sampling(
            tools=tuple(tools.values()), max_new_tokens=PLAN_TOKENS, model=self.settings.plan_model
        )
        calls = []
        async with aclosing(self.generation.generate(messages, sampling, timeout_s)) as reply:
            async for piece in reply:
                if isinstance(piece, str) and piece:
                    return []
                if isinstance(piece, llm_planner.ModelCall):
                    calls.append(piece)
        return calls

    async def _act(
        self, question: Question, tools: dict[str, Tool], state: RunState, tools_until: float
    ) -> AsyncIterator[Event]:
        """Plan -> call tools, until the plan is empty, max_iterations, or the tools' time
        is spent."""
        while True:
            planned = time.monotonic()
            steps, made_by = await self._plan(question, tools, state, tools_until - planned)
            if made_by is Planner.RULES and (steps or not state.observations):
                state.planner = Planner.RULES
            state.hops.append(Hop("plan", time.monotonic() - planned, "agent"))
            if not steps:
                if not state.observations:
                    yield Planned(made_by, ["answer without tools"])
                return
            if state.iterations == question.max_iterations:
                limit = question.max_iterations
                state.fell_short(
                    "max_iterations",
                    f"stopped at max_iterations ({limit}) with tools still to call",
                )
                return
            left_s = tools_until - time.monotonic()
            if left_s <= 0:
                state.fell_short("deadline", "no time was left for more tool calls")
                return
            state.iterations += 1
            yield Planned(made_by, [s.why for s in steps])
            async with aclosing(self._call_all(steps, state, left_s)) as calling:
                async for event in calling:
                    yield event

    async def _call_all(
        self, steps: list[ToolStep], state: RunState, left_s: float
    ) -> AsyncIterator[Event]:
        """Announces every call, runs them at once within `left_s`, reports each as it ends.
        Calls still running when this ends early are cancelled and awaited, so none
        outlives the run."""
        calls = {f"{state.iterations}.{k}": step for k, step in enumerate(steps, start=1)}
        for call_id, step in calls.items():
            yield Calling(call_id, step)
        tasks = [asyncio.create_task(self._call(i, step, left_s)) for i, step in calls.items()]
        try:
            for finished in asyncio.as_completed(tasks):
                call_id, observation, seconds = await finished
                state.observations.append(observation)
                state.hops.append(Hop(observation.step.name, seconds, "tools"))
                if observation.is_error:
                    state.fell_short("tool_failed", f"{observation.step.name}: {observation.text}")
                yield Called(call_id, observation, seconds)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _call(
        self, call_id: str, step: ToolStep, timeout_s: float
    ) -> tuple[str, Observation, float]:
        started = time.monotonic()
        observation: Observation | None
        try:
            async with asyncio.timeout(timeout_s):
                observation = await self.tools.call(step, timeout_s)
        except TimeoutError:
            observation = Observation(
                step, True, f"the call failed (DEADLINE_EXCEEDED): stopped after {timeout_s:.1f} s"
            )
        except Unavailable as error:
            observation = Observation(
                step, True, f"the call failed ({error.reason}): {error.details}"
            )
        if observation is None:
            observation = Observation(step, True, "the tool ended without a result")
        return call_id, replace(observation, call_id=call_id), time.monotonic() - started

    async def _respond(
        self, question: Question, state: RunState, until: float
    ) -> AsyncIterator[Event]:
        """Streams the model's answer; if the model fails, the evidence itself."""
        settings = self.settings
        answered = time.monotonic()
        sampling = Sampling(
            temperature=question.temperature,
            seed=question.seed,
            max_new_tokens=question.max_new_tokens or settings.max_new_tokens,
            repetition_penalty=settings.repetition_penalty,
            model=settings.answer_model,
        )
        messages = prompts.answer_messages(
            question.text, state.observations, settings.passages_in_prompt, question.history
        )
        reply = self.generation.generate(messages, sampling, until - answered)
        try:
            async with aclosing(reply) as pieces:
                async for piece in pieces:
                    if isinstance(piece, Usage):
                        state.usage = piece
                    elif piece:
                        state.answer += piece
                        yield Answered(piece)
        except Unavailable as error:
            state.fell_short(
                "model_failed",
                f"the language model failed ({error.reason}); answered from the evidence",
            )
            fallback = prompts.fallback_answer(state.observations)
            state.answer += ("\n\n" if state.answer else "") + fallback
            yield Answered(fallback)
        state.hops.append(Hop("answer", time.monotonic() - answered, "generation"))


async def _rules(
    question: Question, tools: dict[str, Tool], seen: list[Observation]
) -> list[ToolStep]:
    """The rules' plan after `seen`, with the session's last answer, which a follow-up
    ("Add 100 to that.") may build on. In a worker thread: the rules are cheap but not
    free (a few calculator checks), and the event loop serves every caller."""
    previous = question.history[-1][1] if question.history else ""
    return await asyncio.to_thread(planner.plan, question.text, tools, seen, previous)
