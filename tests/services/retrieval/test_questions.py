"""The retrieval evaluation set: questions a Python programmer asks, with passages that answer.

The set is only as good as its labels, so every relevant id must be a real passage and no
question may give its answer away by naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.retrieval.corpus import Passage, stdlib_passages

pytestmark = pytest.mark.unit

QUESTIONS = Path(__file__).resolve().parents[3] / "loadtest" / "data" / "stdlib_questions.jsonl"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with QUESTIONS.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def passages() -> dict[str, Passage]:
    return {passage.id: passage for passage in stdlib_passages()}


def test_there_are_enough_well_formed_questions(rows: list[dict]):
    assert len(rows) >= 70
    for row in rows:
        assert set(row) == {"question", "relevant"}
        assert isinstance(row["question"], str) and row["question"].strip()
        assert 1 <= len(row["relevant"]) <= 4
        assert len(set(row["relevant"])) == len(row["relevant"])


def test_no_question_is_asked_twice(rows: list[dict]):
    normalised = [" ".join(row["question"].lower().split()) for row in rows]
    assert len(set(normalised)) == len(normalised)


def test_every_relevant_id_is_a_passage(rows: list[dict], passages: dict[str, Passage]):
    missing = [(row["question"], id_) for row in rows for id_ in row["relevant"]]
    assert [pair for pair in missing if pair[1] not in passages] == []


def test_questions_cover_many_modules(rows: list[dict], passages: dict[str, Passage]):
    modules = {
        passages[id_].payload["module"]
        for row in rows
        for id_ in row["relevant"]
        if "module" in passages[id_].payload
    }
    assert len(modules) >= 35


def test_language_topics_are_asked_about_too(rows: list[dict]):
    topical = [row for row in rows if any(id_.startswith("topic:") for id_ in row["relevant"])]
    assert len(topical) >= 10


def test_no_question_names_its_answer(rows: list[dict]):
    leaks = [
        (row["question"], id_)
        for row in rows
        for id_ in row["relevant"]
        if id_.lower() in row["question"].lower()
    ]
    assert leaks == []
