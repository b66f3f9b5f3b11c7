"""The model's plan on its own: the conversation it plans from, and which of its calls
are usable."""

from __future__ import annotations

import json

import pytest

from services.agent import llm_planner
from services.agent.llm_planner import ModelCall
from services.agent.planner import Observation, Tool, ToolStep
from services.tools.builtin import BUILTIN

pytestmark = pytest.mark.unit

ALL = {t.name: Tool(t.name, t.description, t.input_schema) for t in BUILTIN}


def call(name: str, arguments: object) -> ModelCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ModelCall("call_0", name, text)


def test_the_conversation_is_examples_then_the_session_then_the_question_then_the_rounds():
    lookup = ToolStep("python_doc", {"name": "json.dumps"}, "")
    failed = Observation(lookup, True, "x" * 1000, call_id="1.1")
    conversation, shown = llm_planner.messages(
        "What does json.dumps do?", ALL, [("Hi", "Hello.")], [failed]
    )
    assert conversation[0] == {"role": "system", "content": llm_planner.SYSTEM}
    run = conversation[-5:]
    assert run[:3] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What does json.dumps do?"},
    ]
    assert run[3]["tool_calls"] == [
        {"id": "1.1", "name": "python_doc", "arguments": '{"name": "json.dumps"}'}
    ]
    assert run[4]["content"] == "error: " + "x" * llm_planner.RESULT_CHARS
    # What arguments may come from: this run's turns, not the examples'.
    assert "Hello." in shown and "json.dumps" in shown and "12*7+3" not in shown
    assert "12*7+3" in json.dumps(conversation)


def test_examples_only_use_the_runs_tools():
    search = {"knowledge_search": ALL["knowledge_search"]}
    conversation, _ = llm_planner.messages("q", search)
    names = {c["name"] for m in conversation for c in m.get("tool_calls", ())}
    assert names == {"knowledge_search"}
    assert {"role": "user", "content": "Hello!"} in conversation  # answered without tools


@pytest.mark.parametrize(
    ("made", "problem"),
    [
        (call("web", {"q": "x"}), "it names no tool of this run"),
        (call("calculator", '{"expression": "2+'), "its arguments are not JSON (cut short?)"),
        (call("calculator", "[1]"), "its arguments are not a JSON object"),
        (call("python_doc", {"name": "math.pi"}), "math.pi appears nowhere in the conversation"),
        (call("calculator", {"expression": ".23"}), ".23 appears nowhere in the conversation"),
        (call("python_doc", {"name": "add_100"}), "add_100 appears nowhere in the conversation"),
    ],
)
def test_unusable_calls_are_noted(made, problem):
    steps, notes = llm_planner.steps([made], ALL, "What is 17 * 23? Add 100 to that.")
    assert steps == []
    assert notes == [f"the model's call of {made.name} is unusable: {problem}"]


@pytest.mark.parametrize(
    "arguments",
    [
        {"expression": "17 * 23"},
        {"expression": "(17*23)"},
        {"query": "multiply seventeen by twenty-three"},  # words are the model's own
        {"expression": "391 + 100", "nested": [{"x": "391"}]},
    ],
)
def test_arguments_from_the_conversation_are_usable(arguments):
    shown = "What is 17 * 23?\n17 * 23 = 391.\nAdd 100 to that."
    (step,), notes = llm_planner.steps([call("calculator", arguments)], ALL, shown)
    assert (step.name, step.arguments, notes) == ("calculator", arguments, [])


def test_the_usable_calls_are_kept_when_others_are_not():
    made = [call("python_doc", {"name": "json.loads"}), call("python_doc", {"name": "x.y"})]
    steps, notes = llm_planner.steps(made, ALL, "What does json.loads return?")
    assert [s.arguments for s in steps] == [{"name": "json.loads"}]
    assert len(notes) == 1
