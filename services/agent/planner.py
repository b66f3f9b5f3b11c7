"""Which tools to call next, decided by fixed rules over the question and what came back.

This is the deterministic planner: it knows which tool does what by name, and keeps each
argument within the limits that tool's input schema publishes (ListTools), so its calls
validate and it is what acts whenever a model's plan is missing or unusable.

Every extractor is linear in the question's length (no pattern here can backtrack over
what it already matched), and the calculator, which prices each operation before it runs,
only sees a few short candidates, so no question can hold a worker for long.

One rule reads the session: a follow-up that computes on the previous answer ("Add 100 to
that.") becomes a calculation on that answer's number. The 135M model does not resolve
"that" itself (it calls python_doc with a made-up name), so the rules resolve it.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.shared.calculator import CalculationError, calculate

# The tools the rules know how to use, by the names ListTools gives them. What each may
# be given (lengths, ranges) is not known here: it comes from the tool's input schema.
CALCULATOR = "calculator"
GENERATE_IMAGE = "generate_image"
KNOWLEDGE_SEARCH = "knowledge_search"
PYTHON_DOC = "python_doc"

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
# A number as an answer writes it (998,001 or -2.5).
ANSWER_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?", re.ASCII)
# A question that points back at the previous answer.
BACK_REFERENCE = re.compile(r"\b(?:that|it|this|the result|the answer)\b", re.IGNORECASE)
_NUMBER = r"(?P<n>\d+(?:\.\d+)?)"
_WORDS = re.IGNORECASE | re.ASCII
# Operations named in words, each with the expression it makes of the previous answer
# (p) and the question's number (n); the first that matches is used, so "square root"
# comes before "square".
FOLLOW_UPS = (
    (re.compile(rf"\b(?:add|plus)\s+{_NUMBER}", _WORDS), "{p} + {n}"),
    (re.compile(rf"\b{_NUMBER}\s+more\b", _WORDS), "{p} + {n}"),
    (re.compile(rf"\b(?:subtract|minus|take away)\s+{_NUMBER}", _WORDS), "{p} - {n}"),
    (re.compile(rf"\b(?:times|multiplied by|multiply \w+ by)\s+{_NUMBER}", _WORDS), "{p} * {n}"),
    (re.compile(rf"\b(?:divided by|divide \w+ by|over)\s+{_NUMBER}", _WORDS), "{p} / {n}"),
    (re.compile(r"\bdouble\b", _WORDS), "{p} * 2"),
    (re.compile(r"\btriple\b", _WORDS), "{p} * 3"),
    (re.compile(r"\b(?:halve|half)\b", _WORDS), "{p} / 2"),
    (re.compile(r"\bsquare root\b", _WORDS), "sqrt({p})"),
    (re.compile(r"\bsquared?\b", _WORDS), "{p}^2"),
)


@dataclass(frozen=True)
class Tool:
    """One tool as ListTools describes it. Its input schema is another service's output:
    a bound that is missing or not a number is no bound (the tool still checks)."""

    name: str
    description: str
    input_schema: Mapping[str, Any] = field(default_factory=dict)

    def _bound(self, argument: str, keyword: str) -> int | float | None:
        properties = self.input_schema.get("properties")
        schema = properties.get(argument) if isinstance(properties, Mapping) else None
        value = schema.get(keyword) if isinstance(schema, Mapping) else None
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    def max_length(self, argument: str) -> int | None:
        """The argument's maxLength, None when the schema sets none."""
        bound = self._bound(argument, "maxLength")
        return None if bound is None else max(int(bound), 0)

    def admits(self, arguments: Mapping[str, str]) -> bool:
        """Whether each argument (the rules fill in text only) keeps within the lengths the
        schema gives it; the tool validates the rest."""
        for argument, value in arguments.items():
            least = self._bound(argument, "minLength") or 0
            most = self._bound(argument, "maxLength")
            if len(value) < least or (most is not None and len(value) > most):
                return False
        return True


@dataclass(frozen=True)
class ToolStep:
    name: str
    arguments: dict[str, Any]
    why: str

    def key(self) -> str:
        """The call's content: two steps with the same key are the same call."""
        return json.dumps([self.name, self.arguments], sort_keys=True, separators=(",", ":"))


@dataclass
class Observation:
    """What a tool call returned, as the planner and the answer prompt need it."""

    step: ToolStep
    is_error: bool
    text: str
    structured: dict[str, Any] = field(default_factory=dict)
    # "<iteration>.<call>" as the run reported it: which round made the call.
    call_id: str = ""


def _candidates(question: str, max_length: int | None) -> list[str]:
    """The longest few stretches that look like a calculation, edges trimmed."""
    found = []
    for run in ARITHMETIC_RUN.finditer(question):
        text = run.group().lstrip(LEADING_JUNK).rstrip(TRAILING_JUNK)
        if (max_length is None or len(text) <= max_length) and OPERATION.search(text):
            found.append(text)
    return heapq.nlargest(MAX_CANDIDATES, found, key=len)


def arithmetic_in(question: str, max_length: int | None) -> str | None:
    """The longest arithmetic expression in the question, at most `max_length` characters,
    that actually calculates."""
    return next((c for c in _candidates(question, max_length) if _calculates(c, None)), None)


def dotted_name_in(question: str, max_length: int | None) -> str | None:
    """The first dotted name of at most `max_length` characters."""
    names = (m.group() for m in DOTTED_NAME.finditer(question))
    return next((n for n in names if max_length is None or len(n) <= max_length), None)


def follow_up_arithmetic(question: str, previous: str, max_length: int | None) -> str | None:
    """The calculation a follow-up asks for on the previous answer's last number ("Add
    100 to that." after "... = 391." is 391 + 100); None when the question points back at
    nothing, names no operation, or the previous answer holds no number."""
    numbers = ANSWER_NUMBER.findall(previous)
    if not numbers or not BACK_REFERENCE.search(question):
        return None
    p = numbers[-1].replace(",", "")
    for pattern, template in FOLLOW_UPS:
        found = pattern.search(question)
        if found:
            expression = template.format(p=p, n=found.groupdict().get("n"))
            return expression if _calculates(expression, max_length) else None
    return None


def _calculates(expression: str, max_length: int | None) -> bool:
    if max_length is not None and len(expression) > max_length:
        return False
    try:
        calculate(expression)
    except CalculationError:
        return False
    return True


def digit_in(question: str) -> str | None:
    """The first ASCII digit or digit word ("seven") in the question."""
    for match in DIGIT_OR_WORD.finditer(question.lower()):
        word = match.group()
        if word.isdigit():
            return word
        if word in DIGIT_WORDS:
            return str(DIGIT_WORDS.index(word))
    return None


def arguments_for(tool: Tool, question: str, previous: str = "") -> dict[str, Any] | None:
    """The tool's arguments taken from the question (for a follow-up calculation, with
    the `previous` answer), within the limits its schema gives; None when the question
    holds none (or the tool is not one the rules know)."""
    arguments: dict[str, Any] | None = None
    if tool.name == CALCULATOR:
        most = tool.max_length("expression")
        expression = arithmetic_in(question, most) or follow_up_arithmetic(question, previous, most)
        arguments = {"expression": expression} if expression else None
    elif tool.name == PYTHON_DOC:
        name = dotted_name_in(question, tool.max_length("name"))
        arguments = {"name": name} if name else None
    elif tool.name == GENERATE_IMAGE:
        digit = digit_in(question)
        arguments = {"prompt": digit} if digit is not None else None
    elif tool.name == KNOWLEDGE_SEARCH and question.strip():
        arguments = {"query": question[: tool.max_length("query")]}
    return arguments if arguments is not None and tool.admits(arguments) else None


def step(
    tools: Mapping[str, Tool], name: str, question: str, why: str, previous: str = ""
) -> ToolStep | None:
    """A call of `name` with arguments from the question, if it is a tool of this run."""
    tool = tools.get(name)
    arguments = arguments_for(tool, question, previous) if tool is not None else None
    return None if arguments is None else ToolStep(name, arguments, why.format(**arguments))


def first_plan(question: str, tools: Mapping[str, Tool], previous: str = "") -> list[ToolStep]:
    """Independent calls for the first iteration; the loop runs them in parallel.
    `previous`: the session's previous answer, for a follow-up calculation."""
    steps = [step(tools, CALCULATOR, question, "calculate {expression}", previous)]
    if IMAGE_WORDS.search(question):
        steps.append(step(tools, GENERATE_IMAGE, question, "draw the digit {prompt}"))
    steps.append(step(tools, PYTHON_DOC, question, "read the documentation of {name}"))
    found = [s for s in steps if s is not None]
    if found:
        return found
    search = step(tools, KNOWLEDGE_SEARCH, question, "search the knowledge base for the question")
    return [search] if search else []


def next_plan(
    question: str, tools: Mapping[str, Tool], seen: list[Observation], previous: str = ""
) -> list[ToolStep]:
    """Follow-up calls: while no call has succeeded, the first plan's calls not made yet
    (the model's calls may have been other ones); a failed exact lookup becomes a search;
    otherwise none (answer)."""
    if all(o.is_error for o in seen):
        made = {o.step.key() for o in seen}
        fresh = [s for s in first_plan(question, tools, previous) if s.key() not in made]
        if fresh:
            return fresh
    searched = any(o.step.name == KNOWLEDGE_SEARCH for o in seen)
    failed_lookup = any(o.step.name == PYTHON_DOC and o.is_error for o in seen)
    search = step(tools, KNOWLEDGE_SEARCH, question, "search instead")
    return [search] if failed_lookup and not searched and search else []


def plan(
    question: str, tools: Mapping[str, Tool], seen: list[Observation], previous: str = ""
) -> list[ToolStep]:
    """The next calls to make, among `tools` (the run's, by name). `previous`: the
    session's previous answer, "" when there is none."""
    if not seen:
        return first_plan(question, tools, previous)
    return next_plan(question, tools, seen, previous)
