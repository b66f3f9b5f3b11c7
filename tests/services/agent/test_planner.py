"""The rule planner and citation choice, on their own."""

from __future__ import annotations

import pytest

from services.agent import planner, prompts
from services.tools.builtin import BUILTIN

pytestmark = pytest.mark.unit

# The built-in tools as ListTools describes them, schemas included.
ALL = {t.name: planner.Tool(t.name, t.description, t.input_schema) for t in BUILTIN}


@pytest.mark.parametrize(
    ("question", "calls"),
    [
        ("What is (17*23)+4?", [("calculator", {"expression": "(17*23)+4"})]),
        ("What is sqrt(144) + 3?", [("calculator", {"expression": "sqrt(144) + 3"})]),
        ("What does json.loads return?", [("python_doc", {"name": "json.loads"})]),
        ("Draw the digit seven", [("generate_image", {"prompt": "7"})]),
        (
            "What is 6*7, and what does json.loads do?",
            [("calculator", {"expression": "6*7"}), ("python_doc", {"name": "json.loads"})],
        ),
        (
            "How do I copy a nested list?",
            [("knowledge_search", {"query": "How do I copy a nested list?"})],
        ),
        (
            "Python 3.11 release notes",
            [("knowledge_search", {"query": "Python 3.11 release notes"})],
        ),
    ],
)
def test_first_plans(question, calls):
    assert [(s.name, s.arguments) for s in planner.plan(question, ALL, [])] == calls


def test_only_allowed_tools_are_planned():
    search = {"knowledge_search": ALL["knowledge_search"]}
    assert planner.plan("What is 2+2?", search, [])[0].name == "knowledge_search"
    assert planner.plan("What is 2+2?", {}, []) == []


def tool(name: str, /, **properties: dict) -> planner.Tool:
    """A tool whose input schema gives `properties`, as ListTools sends it (numbers as
    floats: JSON Schemas travel in a protobuf Struct)."""
    return planner.Tool(name, name, {"type": "object", "properties": properties})


def test_argument_limits_come_from_the_tools_schema():
    question = "What is 123456+1 and what does os.path.join do?"
    tools = {
        "calculator": tool("calculator", expression={"type": "string", "maxLength": 5.0}),
        "python_doc": tool("python_doc", name={"type": "string", "maxLength": 7.0}),
    }
    assert planner.plan(question, tools, []) == []  # neither fits: nothing to call
    tools["calculator"] = tool("calculator", expression={"type": "string", "maxLength": 8.0})
    tools["python_doc"] = tool("python_doc", name={"maxLength": 12})
    assert [(s.name, s.arguments) for s in planner.plan(question, tools, [])] == [
        ("calculator", {"expression": "123456+1"}),
        ("python_doc", {"name": "os.path.join"}),
    ]
    search = {"knowledge_search": tool("knowledge_search", query={"maxLength": 7.0})}
    (step,) = planner.plan("How do I copy a list?", search, [])
    assert step.arguments == {"query": "How do "}


def test_arguments_outside_the_schemas_range_are_not_planned():
    draw = {"generate_image": tool("generate_image", prompt={"minLength": 2})}
    assert planner.plan("Draw the digit 7", draw, []) == []
    # A schema that is no schema bounds nothing.
    odd = planner.Tool("calculator", "", {"properties": {"expression": {"maxLength": "x"}}})
    assert planner.plan("What is 2+2?", {"calculator": odd}, [])[0].arguments == {
        "expression": "2+2"
    }


def test_a_failed_lookup_turns_into_one_search_then_the_answer():
    lookup = planner.ToolStep("python_doc", {"name": "json.dumps"}, "")
    failed = [planner.Observation(lookup, True, "no such name")]
    (search,) = planner.plan("What does json.dumps do?", ALL, failed)
    assert search.name == "knowledge_search"
    searched = [*failed, planner.Observation(search, False, "", {"passages": []})]
    assert planner.plan("What does json.dumps do?", ALL, searched) == []


def observation(*ids: str) -> planner.Observation:
    step = planner.ToolStep("knowledge_search", {"query": "q"}, "")
    return planner.Observation(
        step, False, "", {"passages": [{"id": i, "text": f"{i} text", "score": 1} for i in ids]}
    )


@pytest.mark.parametrize(
    ("answer", "cited"),
    [
        ("Use [shutil.rmtree] to delete it.", ["shutil.rmtree"]),
        ("Call os.rmdir on the empty folder.", ["os.rmdir"]),
        ("Delete it recursively.", ["shutil.rmtree"]),
        ("See [made.up] for more.", ["shutil.rmtree"]),
    ],
)
def test_citations_follow_what_the_answer_shows(answer, cited):
    seen = [observation("shutil.rmtree", "os.rmdir", "os.remove")]
    assert prompts.cited(answer, seen, limit=4) == cited


@pytest.mark.parametrize(
    ("question", "expression"),
    [
        ("Add 100 to that.", "391 + 100"),
        ("Divide that by 4.", "391 / 4"),
        ("And what is that times 3?", "391 * 3"),
        ("Double it.", "391 * 2"),
        ("What is the square root of that?", "sqrt(391)"),
    ],
)
def test_a_follow_up_calculates_on_the_previous_answer(question, expression):
    steps = planner.plan(question, ALL, [], previous="17 * 23 = 391.")
    assert [(s.name, s.arguments) for s in steps] == [("calculator", {"expression": expression})]


def test_a_follow_up_needs_a_back_reference_and_a_previous_number():
    assert planner.plan("Add 100 to the list.", ALL, [], "= 391")[0].name == "knowledge_search"
    assert planner.plan("Add 100 to that.", ALL, [], "I do not know.")[0].name == "knowledge_search"
    assert planner.plan("Add 100 to that.", ALL, [], "It is 998,001.")[0].arguments == {
        "expression": "998001 + 100"
    }


def test_while_nothing_succeeded_the_rules_make_the_calls_not_made_yet():
    made_up = planner.ToolStep("python_doc", {"name": "math.pi"}, "")
    failed = [planner.Observation(made_up, True, "no such name")]
    assert [s.name for s in planner.plan("What is 2+2?", ALL, failed)] == ["calculator"]
    done = planner.ToolStep("calculator", {"expression": "2+2"}, "")
    assert planner.plan("What is 2+2?", ALL, [planner.Observation(done, True, "broke")]) == []
