"""Which tools to call next, decided by fixed rules over the question and what came back.

This is the deterministic planner: it always produces calls that validate against the
tools' schemas, so it is what acts whenever a model's plan is missing or unusable.

Every extractor is linear in the question's length (no pattern here can backtrack over
what it already matched), and the calculator, which prices each operation before it runs,
only sees a few short candidates, so no question can hold a worker for long.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Any

from services.tools.calculator import CalculationError, calculate

# The tools' input limits (their JSON Schemas): a longer argument would be refused there.
MAX_EXPRESSION = 256
MAX_NAME = 200
MAX_QUERY = 1000
# Arithmetic candidates the calculator tries, longest first; each is priced by the
# calculator before it is evaluated (`3999999^3999999` is refused, not computed).
MAX_CANDIDATES = 8

# A stretch of the characters arithmetic is written in: ASCII digits, operators,
# parentheses, points and spaces, and the calculator's function names before "(". Each
# alternative matches one character or a short name, so a scan never backtracks.
ARITHMETIC_RUN = re.compile(r"(?:\b[a-z]{2,5}\(|[\d+\-*/^%().\s])+", re.ASCII)
# A number followed by an operator: what makes a stretch a calculation, not a version.
OPERATION = re.compile(r"\d[\s.)]*[-+*/^%]", re.ASCII)
# Characters an expression cannot start or end with, trimmed off a stretch's edges.
LEADING_JUNK = ")*/^%. \t\n\r\f\v"
TRAILING_JUNK = "+-*/^%(. \t\n\r\f\v"
# A dotted stdlib-style name, e.g. json.loads or collections.OrderedDict.move_to_end.
DOTTED_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+\b", re.ASCII)
DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Only ASCII digits: int("²") fails, and the image tool takes "0" to "9".
DIGIT_OR_WORD = re.compile(r"[a-z]+|\d", re.ASCII)
IMAGE_WORDS = re.compile(r"\b(draw|image|picture|sketch|generate)\b", re.IGNORECASE | re.ASCII)


@dataclass(frozen=True)
class ToolStep:
    name: str
    arguments: dict[str, Any]
    why: str


@dataclass
class Observation:
    """What a tool call returned, as the planner and the answer prompt need it."""

    step: ToolStep
    is_error: bool
    text: str
    structured: dict[str, Any] = field(default_factory=dict)


def _candidates(question: str) -> list[str]:
    """The longest few stretches that look like a calculation, edges trimmed."""
    found = []
    for run in ARITHMETIC_RUN.finditer(question):
        text = run.group().lstrip(LEADING_JUNK).rstrip(TRAILING_JUNK)
        if len(text) <= MAX_EXPRESSION and OPERATION.search(text):
            found.append(text)
    return heapq.nlargest(MAX_CANDIDATES, found, key=len)


def arithmetic_in(question: str) -> str | None:
    """The longest arithmetic expression in the question that actually calculates."""
    for candidate in _candidates(question):
        try:
            calculate(candidate)
        except CalculationError:
            continue
        return candidate
    return None


def dotted_name_in(question: str) -> str | None:
    """The first dotted name short enough for python_doc."""
    names = (m.group() for m in DOTTED_NAME.finditer(question))
    return next((name for name in names if len(name) <= MAX_NAME), None)


def digit_in(question: str) -> str | None:
    """The first ASCII digit or digit word ("seven") in the question."""
    for match in DIGIT_OR_WORD.finditer(question.lower()):
        word = match.group()
        if word.isdigit():
            return word
        if word in DIGIT_WORDS:
            return str(DIGIT_WORDS.index(word))
    return None


def first_plan(question: str, allowed: set[str]) -> list[ToolStep]:
    """Independent calls for the first iteration; the loop runs them in parallel."""
    steps = []
    expression = arithmetic_in(question) if "calculator" in allowed else None
    if expression:
        steps.append(ToolStep("calculator", {"expression": expression}, f"calculate {expression}"))
    image_digit = digit_in(question) if IMAGE_WORDS.search(question) else None
    if image_digit is not None and "generate_image" in allowed:
        steps.append(
            ToolStep("generate_image", {"prompt": image_digit}, f"draw the digit {image_digit}")
        )
    name = dotted_name_in(question)
    if name and "python_doc" in allowed:
        steps.append(ToolStep("python_doc", {"name": name}, f"read the documentation of {name}"))
    if not steps and question.strip() and "knowledge_search" in allowed:
        steps.append(
            ToolStep(
                "knowledge_search",
                {"query": question[:MAX_QUERY]},
                "search the knowledge base for the question",
            )
        )
    return steps


def next_plan(question: str, allowed: set[str], seen: list[Observation]) -> list[ToolStep]:
    """Follow-up calls: a failed exact lookup becomes a search; otherwise none (answer)."""
    searched = any(o.step.name == "knowledge_search" for o in seen)
    failed_lookup = any(o.step.name == "python_doc" and o.is_error for o in seen)
    if failed_lookup and not searched and question.strip() and "knowledge_search" in allowed:
        return [ToolStep("knowledge_search", {"query": question[:MAX_QUERY]}, "search instead")]
    return []


def plan(question: str, allowed: set[str], seen: list[Observation]) -> list[ToolStep]:
    return first_plan(question, allowed) if not seen else next_plan(question, allowed, seen)
