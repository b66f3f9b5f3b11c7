"""The plan/act loop on its own: fakes at its three interfaces (list tools, call a tool,
generate), no grpc, no servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from mesh.failures import InvalidInput
from services.agent import loop
from services.agent.planner import Observation, Tool, ToolStep
from services.agent.settings import AgentSettings
from services.tools.builtin import BUILTIN

pytestmark = pytest.mark.unit

TOOLS = {t.name: Tool(t.name, t.description, t.input_schema) for t in BUILTIN}
# Tools' outcomes: an Observation's (is_error, text, structured), "fail", "hang" or None.
Outcome = tuple[bool, str, dict] | str | None


class FakeTools:
    def __init__(self, outcomes: dict[str, Outcome], listing: bool = True) -> None:
        self.outcomes = outcomes
        self.listing = listing
        self.calls: list[ToolStep] = []
        self.cancelled: list[str] = []

    async def list(self, timeout_s: float) -> dict[str, Tool]:
        if not self.listing:
            raise loop.Unavailable("UNAVAILABLE", "connection refused")
        return {name: TOOLS[name] for name in self.outcomes}

    async def call(self, step: ToolStep, timeout_s: float) -> Observation | None:
        self.calls.append(step)
        outcome = self.outcomes[step.name]
        if outcome == "fail":
            raise loop.Unavailable("INTERNAL", "the tool broke")
        if outcome == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(step.name)
                raise
        if outcome is None:
            return None
        is_error, text, structured = outcome
        return Observation(step, is_error, text, structured)


class FakeGeneration:
    """Picks `choice` when asked for a plan (fails when None); answers with `answer`
    (fails when None)."""

    def __init__(self, choice: str | None = "answer", answer: str | None = "An answer.") -> None:
        self.choice = choice
        self.answer = answer
        self.prompts: list[str] = []

    async def generate(
        self, messages: list[dict[str, str]], sampling: loop.Sampling, timeout_s: float
    ) -> AsyncIterator[str | loop.Usage]:
        text = self.choice if sampling.choices else self.answer
        if not sampling.choices:
            self.prompts.append(messages[-1]["content"])
        if text is None:
            raise loop.Unavailable("UNAVAILABLE", "no model")
        yield text
        yield loop.Usage(10, 2, 12)


async def run(
    tools: FakeTools,
    generation: FakeGeneration,
    question: str,
    left_s: float | None = None,
    settings: AgentSettings | None = None,
    **fields: object,
) -> tuple[list[loop.Event], loop.RunState]:
    state = loop.RunState()
    runner = loop.Loop(tools, generation, settings or AgentSettings())
    events = [e async for e in runner.run(loop.Question(question, **fields), left_s, state)]
    return events, state


def answer(events: list[loop.Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, loop.Answered))


async def test_a_failed_tool_is_a_note_and_the_answer_still_comes():
    tools = FakeTools({"calculator": "fail", "python_doc": None})
    generation = FakeGeneration(choice="calculator")
    events, state = await run(tools, generation, "What is 6*7, and what is json.loads?")
    assert "calculator: the call failed (INTERNAL): the tool broke" in state.notes
    assert "python_doc: the tool ended without a result" in state.notes
    called = [e for e in events if isinstance(e, loop.Called)]
    assert sorted(e.observation.step.name for e in called) == ["calculator", "python_doc"]
    assert all(e.observation.is_error for e in called)
    assert answer(events) == "An answer."
    assert state.usage == loop.Usage(10, 2, 12)
    assert state.planner == loop.Planner.MODEL


async def test_a_spent_budget_stops_the_tools_and_answers_from_what_it_has():
    tools = FakeTools({"calculator": (False, "42", {"value": 42}), "python_doc": "hang"})
    settings = AgentSettings(answer_share=0.5, answer_min_s=0.1, wrap_up_s=0)
    generation = FakeGeneration()
    started = time.monotonic()
    events, state = await run(
        tools, generation, "What is 6*7, and what is json.loads?", 1.0, settings
    )
    assert time.monotonic() - started < 1.0
    assert tools.cancelled == ["python_doc"]
    stopped = [n for n in state.notes if n.startswith("python_doc: the call failed")]
    assert stopped and "DEADLINE_EXCEEDED" in stopped[0]
    assert "too little time to ask the model for a plan; planned by rules" in state.notes
    assert state.planner == loop.Planner.RULES
    # The answer is made from the evidence that came back in time.
    assert answer(events) == "An answer."
    assert "calculator: 42" in generation.prompts[0]
    assert [o.step.name for o in state.observations] == ["calculator", "python_doc"]


async def test_with_no_time_for_tools_the_run_answers_without_calling_any():
    tools = FakeTools({"calculator": (False, "4", {})})
    events, state = await run(tools, FakeGeneration(), "What is 2+2?", left_s=0.5)
    assert tools.calls == []
    assert "no time was left for more tool calls" in state.notes
    assert answer(events) == "An answer."


async def test_the_evidence_reaches_the_answer_and_its_fallback():
    tools = FakeTools({"calculator": (False, "4", {"value": 4})})
    generation = FakeGeneration(choice="calculator")
    events, state = await run(tools, generation, "What is 2+2?")
    assert "calculator: 4" in generation.prompts[0]
    assert state.planner == loop.Planner.MODEL and state.iterations == 1
    events, state = await run(tools, FakeGeneration(choice=None, answer=None), "What is 2+2?")
    assert answer(events) == "The calculator gives 4."
    assert "the planning model failed (UNAVAILABLE); planned by rules" in state.notes
    assert any("the language model failed (UNAVAILABLE)" in n for n in state.notes)


async def test_unlisted_tools_mean_an_answer_without_tools():
    tools = FakeTools({"calculator": (False, "4", {})}, listing=False)
    events, state = await run(tools, FakeGeneration(), "What is 2+2?")
    assert tools.calls == []
    assert state.notes == ["the tools service was unavailable; answered without tools"]
    assert events[0] == loop.Planned(loop.Planner.RULES, ["answer without tools"])
    assert answer(events) == "An answer."


async def test_naming_a_tool_the_service_does_not_serve_is_invalid():
    tools = FakeTools({"calculator": (False, "4", {})})
    with pytest.raises(InvalidInput) as refused:
        await run(tools, FakeGeneration(), "What is 2+2?", allowed_tools=("web",))
    assert refused.value.violations[0].field == "options.allowed_tools"


async def test_max_iterations_stops_the_follow_up():
    tools = FakeTools({"python_doc": (True, "no such name", {}), "knowledge_search": "fail"})
    generation = FakeGeneration(choice="python_doc")
    _, state = await run(tools, generation, "What is json.dumps?", max_iterations=1)
    assert [s.name for s in tools.calls] == ["python_doc"]
    assert "stopped at max_iterations (1) with tools still to call" in state.notes


def test_the_loop_runs_without_grpc():
    code = "import sys, services.agent.loop; assert 'grpc' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
