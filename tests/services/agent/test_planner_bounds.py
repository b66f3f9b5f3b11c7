"""The agent's bounds, in process and without the mesh: the rule planner is linear and
never raises, every Run field is validated, and a run degrades (never raises, never
leaks a tool call) when tools or generation misbehave. Tools and generation are fakes on
loopback gRPC, reached through the mesh's own channels."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from aimesh.agent.v1 import agent_pb2
from mesh import caller
from mesh.failures import InvalidInput
from services.agent import llm_planner, loop, planner, servicer
from services.agent.servicer import check_request
from services.tools.builtin import BUILTIN
from tests.services.agent.conftest import (
    FakeGeneration,
    FakeTools,
    failure,
    final,
    no_result,
    pending_tool_calls,
    result,
    run_all,
)

pytestmark = pytest.mark.service

SCHEMAS = {tool.name: Draft202012Validator(tool.input_schema) for tool in BUILTIN}
# The built-in tools as ListTools describes them: the planner's limits are their schemas'.
ALL = {t.name: planner.Tool(t.name, t.description, t.input_schema) for t in BUILTIN}
MAX_EXPRESSION = ALL["calculator"].max_length("expression")
MAX_NAME = ALL["python_doc"].max_length("name")
KB = 100 * 1024


def assert_valid(steps: list[planner.ToolStep]) -> None:
    for step in steps:
        assert step.name in ALL
        errors = [e.message for e in SCHEMAS[step.name].iter_errors(step.arguments)]
        assert not errors, (step, errors)


# -- the planner: linear, bounded, never raises ----------------------------------------

ADVERSARIAL = {
    "plus signs": "+" * KB,
    "open parens": "(" * KB,
    "nested parens": "(" * (KB // 2) + "1" + ")" * (KB // 2),
    "one point": "1." * (KB // 2),
    "dotted letters": "a." * (KB // 2),
    "dotted letters, accent last": "a." * (KB // 2) + "é",
    "spaces": "What is " + " " * KB + "1+",
    "spaced digits": "1 " * (KB // 2),
    "a number then operators": "1" + "+" * KB,
    "function names": "sqrt(" * (KB // 5),
    "superscripts": "draw ² " * (KB // 7),
    "arabic-indic digits": "draw ٣+٤ " * (KB // 9),
    "many small sums": "1+) " * (KB // 4),
}


@pytest.mark.parametrize("question", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_adversarial_questions_plan_fast(question):
    started = time.monotonic()
    llm_planner.made_up({"query": question}, question)
    steps = planner.plan(question, ALL, [], previous=question)
    assert time.monotonic() - started < 1.0
    assert_valid(steps)


@pytest.mark.parametrize(
    "question", ["What is 3999999^3999999?", "9^3999999 // 7^1999999", "(3999999^3999999)^2"]
)
def test_costly_arithmetic_is_refused_not_computed(question):
    started = time.monotonic()
    assert planner.arithmetic_in(question, MAX_EXPRESSION) is None
    assert time.monotonic() - started < 1.0  # computing it would take tens of seconds


def test_the_calculator_tries_a_few_candidates_only(monkeypatch):
    evaluated = []

    def refuse(expression: str) -> None:
        evaluated.append(expression)
        raise planner.CalculationError("no")

    monkeypatch.setattr(planner, "calculate", refuse)
    assert planner.arithmetic_in("2+2 is not 5+1, " * 1000, MAX_EXPRESSION) is None
    assert 0 < len(evaluated) <= planner.MAX_CANDIDATES


@pytest.mark.parametrize(
    ("question", "expression"),
    [("What is 2^0.5?", "2^0.5"), ("(7/3)^20 please", "(7/3)^20"), ("2^1000", "2^1000")],
)
def test_cheap_arithmetic_still_calculates(question, expression):
    assert planner.arithmetic_in(question, MAX_EXPRESSION) == expression


@pytest.mark.parametrize("question", ["Draw the digit ٣", "draw ²", "sketch a ₇"])
def test_only_ascii_digits_are_drawn(question):
    assert planner.digit_in(question) is None
    assert all(s.name != "generate_image" for s in planner.plan(question, ALL, []))


def test_a_dotted_name_too_long_for_python_doc_is_not_looked_up():
    question = f"What is {'a.' * 150}b? And os.path.join?"
    assert planner.dotted_name_in(question, MAX_NAME) == "os.path.join"


ARITHMETIC_TEXT = st.text(alphabet=st.sampled_from(list("0123456789+-*/^%(). sqrtlogé²٣\n")))


@settings(max_examples=200, deadline=None)
@given(
    question=st.one_of(st.text(), ARITHMETIC_TEXT),
    previous=st.one_of(st.text(), ARITHMETIC_TEXT),
    seen_lookup_failed=st.booleans(),
)
def test_any_text_plans_valid_calls(question, previous, seen_lookup_failed):
    lookup = planner.ToolStep("python_doc", {"name": "json.dumps"}, "")
    seen = [planner.Observation(lookup, True, "no such name")] if seen_lookup_failed else []
    assert_valid(planner.plan(question, ALL, seen, previous))
    assert_valid(planner.plan(f"Add 1 to that. {question}", ALL, seen, previous))


# -- validation: INVALID_ARGUMENT naming the field -------------------------------------


def options(**fields: object) -> agent_pb2.RunOptions:
    return agent_pb2.RunOptions(**fields)


BAD_REQUESTS = {
    "empty question": (agent_pb2.RunRequest(question=""), "question"),
    "blank question": (agent_pb2.RunRequest(question=" \n\t"), "question"),
    "question past 8 KiB": (
        agent_pb2.RunRequest(question="é" * 4097),
        "question",
    ),
    "question of 100 kB": (agent_pb2.RunRequest(question="+" * KB), "question"),
    "request id with a space": (agent_pb2.RunRequest(question="q", request_id="a b"), "request_id"),
    "request id not ASCII": (agent_pb2.RunRequest(question="q", request_id="ü"), "request_id"),
    "request id too long": (agent_pb2.RunRequest(question="q", request_id="x" * 129), "request_id"),
    "zero iterations": (
        agent_pb2.RunRequest(question="q", options=options(max_iterations=0)),
        "options.max_iterations",
    ),
    "negative iterations": (
        agent_pb2.RunRequest(question="q", options=options(max_iterations=-1)),
        "options.max_iterations",
    ),
    "too many iterations": (
        agent_pb2.RunRequest(question="q", options=options(max_iterations=2**31 - 1)),
        "options.max_iterations",
    ),
    "negative max_new_tokens": (
        agent_pb2.RunRequest(question="q", options=options(max_new_tokens=-1)),
        "options.max_new_tokens",
    ),
    "huge max_new_tokens": (
        agent_pb2.RunRequest(question="q", options=options(max_new_tokens=2**31 - 1)),
        "options.max_new_tokens",
    ),
    "NaN temperature": (
        agent_pb2.RunRequest(question="q", options=options(temperature=math.nan)),
        "options.temperature",
    ),
    "infinite temperature": (
        agent_pb2.RunRequest(question="q", options=options(temperature=math.inf)),
        "options.temperature",
    ),
    "negative temperature": (
        agent_pb2.RunRequest(question="q", options=options(temperature=-0.5)),
        "options.temperature",
    ),
    "too many tools": (
        agent_pb2.RunRequest(question="q", options=options(allowed_tools=["calculator"] * 65)),
        "options.allowed_tools",
    ),
    "an empty tool name": (
        agent_pb2.RunRequest(question="q", options=options(allowed_tools=["calculator", ""])),
        "options.allowed_tools[1]",
    ),
    "a tool name no tool can have": (
        agent_pb2.RunRequest(question="q", options=options(allowed_tools=["web search"])),
        "options.allowed_tools[0]",
    ),
}


@pytest.mark.parametrize(("request_", "field"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_name_the_field(request_, field):
    with pytest.raises(InvalidInput) as refused:
        check_request(request_)
    assert field in [v.field for v in refused.value.violations]


def test_a_long_non_ascii_question_within_the_limit_is_accepted():
    check_request(agent_pb2.RunRequest(question="¿Qué es 2+2? " + "日本語" * 300))


def test_thousands_of_bad_tool_names_are_reported_briefly():
    request = agent_pb2.RunRequest(question="q", options=options(allowed_tools=["?" * 100] * 5000))
    with pytest.raises(InvalidInput) as refused:
        check_request(request)
    assert len(refused.value.violations) <= 10
    assert len(str(refused.value)) < 2000


def test_a_huge_tool_list_is_refused_without_reading_it(monkeypatch):
    read = []
    rule = SimpleNamespace(fullmatch=lambda name: read.append(name) or True)
    monkeypatch.setattr(servicer, "TOOL_NAME", rule)
    request = agent_pb2.RunRequest(question="q", options=options(allowed_tools=["a"] * 100_000))
    with pytest.raises(InvalidInput):
        check_request(request)
    assert len(read) <= servicer.MAX_ALLOWED_TOOLS


def test_unknown_tools_are_named_briefly():
    available = {name: ALL[name] for name in ("calculator", "knowledge_search")}
    names = [f"tool{i}" for i in range(64)]
    with pytest.raises(InvalidInput) as refused:
        loop.select_tools(["calculator", *names], available)
    (violation,) = refused.value.violations
    assert violation.field == "options.allowed_tools"
    assert "tool0" in violation.description and len(violation.description) < 500
    assert loop.select_tools(["calculator"], available) == {"calculator": ALL["calculator"]}
    assert loop.select_tools([], available) == available


# -- degradation: a run answers whatever its tools and model do -------------------------


async def test_failed_and_resultless_tool_calls_become_notes(start_agent):
    tools = FakeTools(
        {"calculator": no_result, "python_doc": failure, "knowledge_search": result("found")}
    )
    agent = await start_agent(tools, FakeGeneration())
    events = await run_all(agent, "What is 6*7, and what does json.loads do?")
    notes = "\n".join(final(events).notes)
    assert "calculator: the tool ended without a result" in notes
    assert "python_doc: the call failed (INTERNAL)" in notes
    assert "".join(e.answer_delta.text for e in events) == "An answer."


async def test_malformed_passages_cost_evidence_not_the_answer(start_agent):
    passages = [{"id": "ok", "text": ""}, {"text": "no id"}, "junk", {"id": 3, "text": "x"}]
    tools = FakeTools(
        {
            "knowledge_search": result("3 passages", {"passages": passages}),
            "python_doc": result("doc", {"name": "x.y", "passage_ids": [], "text": "doc"}),
        }
    )
    plan = [
        ("knowledge_search", {"query": "How do I copy a list?"}),
        ("python_doc", {"name": "x.y"}),
    ]
    agent = await start_agent(tools, FakeGeneration([plan], answer=None))
    events = await run_all(agent, "How do I copy a list? See x.y")
    answer = "".join(e.answer_delta.text for e in events)
    assert "[ok]" in answer
    assert any("the language model failed" in note for note in final(events).notes)


async def test_unreachable_tools_still_get_an_answer(start_agent, unused_tcp_port):
    agent = await start_agent(FakeTools({}), FakeGeneration(), f"127.0.0.1:{unused_tcp_port}")
    events = await run_all(agent, "What is 2+2?")
    assert "".join(e.answer_delta.text for e in events) == "An answer."
    assert "answered without tools" in "\n".join(final(events).notes)


async def test_the_models_pick_outside_the_allowed_tools_is_not_called(start_agent):
    tools = FakeTools({"calculator": result("4"), "knowledge_search": result("found")})
    generation = FakeGeneration([[("calculator", {"expression": "2+2"})]])
    agent = await start_agent(tools, generation)
    events = await run_all(agent, "What is 2+2?", allowed_tools=["knowledge_search"])
    assert tools.calls == ["knowledge_search"]
    assert final(events).planner == agent_pb2.PLANNER_FALLBACK
    assert [t.name for t in generation.plan_requests[0].tools] == ["knowledge_search"]
    assert final(events).notes[:2] == [
        "the model's call of calculator is unusable: it names no tool of this run",
        "no call of the model's is usable; planned by rules",
    ]


async def test_a_cancelled_run_cancels_and_awaits_its_tool_calls(start_agent):
    tools = FakeTools({"knowledge_search": "hang"})
    agent = await start_agent(tools, FakeGeneration())
    run = agent.Run(agent_pb2.RunRequest(question="How do I copy a list?"), None)
    consumer = asyncio.create_task(anext_until_stuck(run))
    await asyncio.wait_for(tools.started.wait(), 10)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert pending_tool_calls() == []
    await asyncio.wait_for(tools.cancelled.wait(), 10)
    await run.aclose()


async def test_a_closed_run_cancels_and_awaits_its_tool_calls(start_agent):
    tools = FakeTools({"calculator": result("4"), "knowledge_search": "hang"})
    plan = [("knowledge_search", {"query": "What is 2+2?"}), ("calculator", {"expression": "2+2"})]
    agent = await start_agent(tools, FakeGeneration([plan]))
    run = agent.Run(agent_pb2.RunRequest(question="What is 2+2?"), None)
    async for message in run:
        if message.HasField("tool_result"):
            break
    assert pending_tool_calls()
    await run.aclose()
    assert pending_tool_calls() == []
    await asyncio.wait_for(tools.cancelled.wait(), 10)


async def anext_until_stuck(run: AsyncIterator) -> None:
    """Consumes events until the run waits on something that never comes."""
    async for _ in run:
        pass


async def test_the_callers_client_identity_reaches_the_tools(start_agent):
    tools = FakeTools({"calculator": result("4"), "python_doc": result("doc")})
    plan = [("calculator", {"expression": "2+2"}), ("python_doc", {"name": "json.loads"})]
    generation = FakeGeneration([plan])
    agent = await start_agent(tools, generation)
    # What the server interceptor does with the caller's metadata (mesh.caller).
    caller.adopt(SimpleNamespace(invocation_metadata=lambda: (("x-aimesh-client", "alice"),)))
    await run_all(agent, "What is 2+2, and json.loads?")
    assert sorted(tools.calls) == ["calculator", "python_doc"]
    assert tools.clients == [["alice"], ["alice"]]
    # A call from inside the mesh (no client header) is sent on without one.
    caller.adopt(SimpleNamespace(invocation_metadata=lambda: None))
    generation.plans = [[("calculator", {"expression": "2+2"})]]
    await run_all(agent, "What is 2+2?")
    assert tools.clients[2:] == [[]]


async def test_argument_limits_come_from_list_tools(start_agent):
    schemas = {"calculator": {"properties": {"expression": {"type": "string", "maxLength": 3}}}}
    tools = FakeTools({"calculator": result("4"), "knowledge_search": result("found")}, schemas)
    generation = FakeGeneration()
    agent = await start_agent(tools, generation)
    events = await run_all(agent, "What is 20+22?")
    # The model is offered the schema as the tool wrote it, whole numbers as integers (a
    # grammar compiler refuses a maxLength of 3.0).
    (offered,) = [t for t in generation.plan_requests[0].tools if t.name == "calculator"]
    assert json.loads(offered.parameters)["properties"]["expression"] == {
        "type": "string",
        "maxLength": 3,
    }
    assert "3.0" not in offered.parameters
    # Its plan failed; for the rules 20+22 is longer than this calculator takes: they search.
    assert tools.calls == ["knowledge_search"]
    notes = final(events).notes
    assert "the planning model failed (INTERNAL); planned by rules" in notes
    assert [c.name for c in (e.tool_call for e in events if e.HasField("tool_call"))] == [
        "knowledge_search"
    ]
