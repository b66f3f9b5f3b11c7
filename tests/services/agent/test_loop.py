"""The plan/act loop on its own: fakes at its three interfaces (list tools, call a tool,
generate), no grpc, no servers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from mesh.failures import InvalidInput
from services.agent import llm_planner, loop
from services.agent.planner import Observation, Tool, ToolStep
from services.agent.settings import AgentSettings
from services.tools.builtin import BUILTIN

pytestmark = pytest.mark.unit

TOOLS = {t.name: Tool(t.name, t.description, t.input_schema) for t in BUILTIN}
CALCULATE_6_7 = ("calculator", {"expression": "6*7"})
# Tools' outcomes: an Observation's (is_error, text, structured), "fail", "hang" or None.
Outcome = tuple[bool, str, dict] | str | None


class FakeTools:
    def __init__(self, outcomes: dict[str, Outcome], listing: bool = True) -> None:
        self.outcomes = outcomes
        self.listing = listing
        self.calls: list[ToolStep] = []
        self.cancelled: list[str] = []

    async def list(self, timeout_s: float) -> loop.Catalogue:
        if not self.listing:
            raise loop.Unavailable("UNAVAILABLE", "connection refused")
        return loop.Catalogue({name: TOOLS[name] for name in self.outcomes})

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
    """Plans `plans` in turn, one per planning request, then answers instead of calling
    (fails every plan when None); answers with `answer` (fails when None). Keeps each
    planning conversation and each answer prompt's last turn."""

    def __init__(
        self, plans: list[list[tuple[str, dict]]] | None = None, answer: str | None = "An answer."
    ) -> None:
        self.plans = plans
        self.answer = answer
        self.conversations: list[list[dict]] = []
        self.prompts: list[str] = []

    async def generate(
        self, messages: list[dict], sampling: loop.Sampling, timeout_s: float
    ) -> AsyncIterator[str | llm_planner.ModelCall | loop.Usage]:
        if sampling.tools:
            self.conversations.append(messages)
            if self.plans is None:
                raise loop.Unavailable("UNAVAILABLE", "no model")
            calls = self.plans.pop(0) if self.plans else []
            if not calls:
                yield "Hi"
            for k, (name, arguments) in enumerate(calls):
                yield llm_planner.ModelCall(f"call_{k}", name, json.dumps(arguments))
            return
        self.prompts.append(messages[-1]["content"])
        if self.answer is None:
            raise loop.Unavailable("UNAVAILABLE", "no model")
        yield self.answer
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
    generation = FakeGeneration([[CALCULATE_6_7, ("python_doc", {"name": "json.loads"})]])
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
    generation = FakeGeneration([[("calculator", {"expression": "2+2"})]])
    events, state = await run(tools, generation, "What is 2+2?")
    assert "calculator: 4" in generation.prompts[0]
    assert state.planner == loop.Planner.MODEL and state.iterations == 1
    events, state = await run(tools, FakeGeneration(answer=None), "What is 2+2?")
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
    generation = FakeGeneration([[("python_doc", {"name": "json.dumps"})]])
    _, state = await run(tools, generation, "What is json.dumps?", max_iterations=1)
    assert [s.name for s in tools.calls] == ["python_doc"]
    assert "stopped at max_iterations (1) with tools still to call" in state.notes


def test_the_loop_runs_without_grpc():
    code = "import sys, services.agent.loop; assert 'grpc' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- planning with the model's tool calls ----------------------------------------------


def roles(conversation: list[dict]) -> list[str]:
    return [m["role"] for m in conversation]


async def test_the_plan_is_the_models_calls_made_in_parallel():
    tools = FakeTools({"calculator": (False, "42", {}), "python_doc": (False, "doc", {})})
    lookup = ("python_doc", {"name": "json.loads"})
    generation = FakeGeneration([[CALCULATE_6_7, lookup]])
    events, state = await run(tools, generation, "What is 6*7, and what does json.loads do?")
    assert [(s.name, s.arguments) for s in tools.calls] == [CALCULATE_6_7, lookup]
    calling = [e.call_id for e in events if isinstance(e, loop.Calling)]
    assert calling == ["1.1", "1.2"]
    assert events[0] == loop.Planned(
        loop.Planner.MODEL, ["calculator (the model's call)", "python_doc (the model's call)"]
    )
    assert (state.planner, state.iterations, state.notes) == (loop.Planner.MODEL, 1, [])
    # The second round saw both calls and both results, and answered (stopped calling).
    follow_up = generation.conversations[1]
    assert roles(follow_up)[-4:] == ["user", "assistant", "tool", "tool"]
    made = follow_up[-3]["tool_calls"]
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in made] == [
        ("1.1", *CALCULATE_6_7),
        ("1.2", *lookup),
    ]
    assert {(m["tool_call_id"], m["content"]) for m in follow_up[-2:]} == {
        ("1.1", "42"),
        ("1.2", "doc"),
    }


async def test_the_rules_add_a_first_round_call_to_a_tool_the_model_left_out():
    tools = FakeTools({"calculator": (False, "42", {}), "python_doc": (False, "doc", {})})
    lookup = ("python_doc", {"name": "json.loads"})
    events, state = await run(
        tools, FakeGeneration([[lookup]]), "What is 6*7, and what does json.loads do?"
    )
    assert [(s.name, s.arguments) for s in tools.calls] == [lookup, CALCULATE_6_7]
    assert events[0].planner is loop.Planner.MODEL and state.iterations == 1
    assert state.notes == ["the rules added calculator, which the model did not call"]


async def test_later_rounds_are_the_models_too_and_see_failures():
    tools = FakeTools(
        {"python_doc": (True, "no such name", {}), "knowledge_search": (False, "found", {})}
    )
    search = ("knowledge_search", {"query": "json.dumps"})
    generation = FakeGeneration([[("python_doc", {"name": "json.dumps"})], [search]])
    events, state = await run(tools, generation, "What does json.dumps do?")
    assert [(s.name, s.arguments) for s in tools.calls] == [
        ("python_doc", {"name": "json.dumps"}),
        search,
    ]
    assert (state.planner, state.iterations) == (loop.Planner.MODEL, 2)
    assert [e.planner for e in events if isinstance(e, loop.Planned)] == [loop.Planner.MODEL] * 2
    assert generation.conversations[1][-1] == {
        "role": "tool",
        "tool_call_id": "1.1",
        "content": "error: no such name",
    }
    assert roles(generation.conversations[2])[-4:] == ["assistant", "tool", "assistant", "tool"]


async def test_the_model_may_answer_without_tools():
    tools = FakeTools({"calculator": (False, "4", {})})
    events, state = await run(tools, FakeGeneration([[]]), "Hello!")
    assert tools.calls == []
    assert events[0] == loop.Planned(loop.Planner.MODEL, ["answer without tools"])
    assert (state.planner, state.notes) == (loop.Planner.MODEL, [])


async def test_a_call_already_made_is_not_made_again():
    tools = FakeTools({"calculator": (False, "4", {})})
    again = [("calculator", {"expression": "2+2"})]
    _, state = await run(tools, FakeGeneration([again, again]), "What is 2+2?")
    assert len(tools.calls) == 1 and state.iterations == 1
    assert (state.planner, state.notes) == (loop.Planner.MODEL, [])


async def test_made_up_arguments_fall_back_to_the_rules_with_a_note():
    tools = FakeTools({"calculator": (False, "391", {}), "python_doc": (False, "doc", {})})
    generation = FakeGeneration([[("python_doc", {"name": "math.pi"})]])
    _, state = await run(tools, generation, "What is 17 * 23?")
    assert [(s.name, s.arguments) for s in tools.calls] == [
        ("calculator", {"expression": "17 * 23"})
    ]
    assert state.notes == [
        "the model's call of python_doc is unusable: math.pi appears nowhere in the conversation",
        "no call of the model's is usable; planned by rules",
    ]
    assert state.planner == loop.Planner.RULES


async def test_when_the_model_stops_with_nothing_succeeded_the_rules_go_on():
    tools = FakeTools(
        {"python_doc": (True, "no such name", {}), "knowledge_search": (False, "found", {})}
    )
    generation = FakeGeneration([[("python_doc", {"name": "json.dumps"})]])
    _, state = await run(tools, generation, "What does json.dumps do?")
    assert [s.name for s in tools.calls] == ["python_doc", "knowledge_search"]
    assert "the model stopped with no call succeeded; planned by rules" in state.notes
    assert state.planner == loop.Planner.RULES


async def test_a_model_that_keeps_calling_stops_at_max_iterations():
    tools = FakeTools({"calculator": (False, "2", {})})
    plans = [[("calculator", {"expression": f"{n}+{n}"})] for n in range(1, 4)]
    question = "What are 1+1, 2+2 and 3+3?"
    _, state = await run(tools, FakeGeneration(plans), question, max_iterations=2)
    assert len(tools.calls) == 2
    assert "stopped at max_iterations (2) with tools still to call" in state.notes


SESSION = (("What is 17 * 23?", "17 * 23 = 391."),)


async def test_plans_see_the_sessions_earlier_turns():
    tools = FakeTools({"calculator": (False, "491", {})})
    generation = FakeGeneration([[("calculator", {"expression": "391 + 100"})]])
    _, state = await run(tools, generation, "Add 100 to that.", history=SESSION)
    conversation = generation.conversations[0]
    assert conversation[-3:] == [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "17 * 23 = 391."},
        {"role": "user", "content": "Add 100 to that."},
    ]
    # 391 comes from the session, 100 from the question: the call is the model's.
    assert tools.calls[0].arguments == {"expression": "391 + 100"}
    assert (state.planner, state.notes) == (loop.Planner.MODEL, [])


async def test_the_rules_resolve_that_against_the_previous_answer():
    tools = FakeTools({"calculator": (False, "491", {}), "knowledge_search": (False, "", {})})
    _, state = await run(tools, FakeGeneration(), "Add 100 to that.", history=SESSION)
    assert [(s.name, s.arguments) for s in tools.calls] == [
        ("calculator", {"expression": "391 + 100"})
    ]
    assert state.notes == ["the planning model failed (UNAVAILABLE); planned by rules"]
