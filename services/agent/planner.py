"""Which tools to call next, decided by fixed rules over the question and what came back.

This is the deterministic planner: it always produces calls that validate against the
tools' schemas, so it is what acts whenever a model's plan is missing or unusable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from services.tools.calculator import CalculationError, calculate

# Numbers joined by operators (at least one), calls of the calculator's functions
# included: "(17*23)+4", "2^10", "sqrt(144) + 3".
_OPERAND = r"(?:[a-z]{2,5}\(\s*)*[-+(\s]*\d[\d.\s)]*"
ARITHMETIC = re.compile(rf"{_OPERAND}(?:[-+*/^%]+{_OPERAND})+")
# A dotted stdlib-style name, e.g. json.loads or collections.OrderedDict.move_to_end.
DOTTED_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+\b")
DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
IMAGE_WORDS = re.compile(r"\b(draw|image|picture|sketch|generate)\b", re.IGNORECASE)


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


def arithmetic_in(question: str) -> str | None:
    """The longest arithmetic expression in the question that actually calculates."""
    candidates = sorted(
        (m.group().strip() for m in ARITHMETIC.finditer(question)), key=len, reverse=True
    )
    for candidate in candidates:
        try:
            calculate(candidate)
        except CalculationError:
            continue
        return candidate
    return None


def digit_in(question: str) -> str | None:
    words = re.findall(r"[a-z]+|\d", question.lower())
    for word in words:
        if word.isdigit():
            return word
        if word in DIGIT_WORDS:
            return str(DIGIT_WORDS.index(word))
    return None


def first_plan(question: str, allowed: set[str]) -> list[ToolStep]:
    """Independent calls for the first iteration; the loop runs them in parallel."""
    steps = []
    expression = arithmetic_in(question)
    if expression and "calculator" in allowed:
        steps.append(ToolStep("calculator", {"expression": expression}, f"calculate {expression}"))
    image_digit = digit_in(question) if IMAGE_WORDS.search(question) else None
    if image_digit is not None and "generate_image" in allowed:
        steps.append(
            ToolStep("generate_image", {"prompt": image_digit}, f"draw the digit {image_digit}")
        )
    name = next(iter(DOTTED_NAME.findall(question)), None)
    if name and "python_doc" in allowed:
        steps.append(ToolStep("python_doc", {"name": name}, f"read the documentation of {name}"))
    if not steps and "knowledge_search" in allowed:
        steps.append(
            ToolStep(
                "knowledge_search",
                {"query": question[:1000]},
                "search the knowledge base for the question",
            )
        )
    return steps


def next_plan(question: str, allowed: set[str], seen: list[Observation]) -> list[ToolStep]:
    """Follow-up calls: a failed exact lookup becomes a search; otherwise none (answer)."""
    searched = any(o.step.name == "knowledge_search" for o in seen)
    failed_lookup = any(o.step.name == "python_doc" and o.is_error for o in seen)
    if failed_lookup and not searched and "knowledge_search" in allowed:
        return [ToolStep("knowledge_search", {"query": question[:1000]}, "search instead")]
    return []


def plan(question: str, allowed: set[str], seen: list[Observation]) -> list[ToolStep]:
    return first_plan(question, allowed) if not seen else next_plan(question, allowed, seen)
