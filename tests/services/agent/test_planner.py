"""The rule planner and citation choice, on their own."""

from __future__ import annotations

import pytest

from services.agent import planner, prompts

ALL = {"calculator", "knowledge_search", "python_doc", "generate_image"}


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
    assert planner.plan("What is 2+2?", {"knowledge_search"}, [])[0].name == "knowledge_search"
    assert planner.plan("What is 2+2?", set(), []) == []


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
