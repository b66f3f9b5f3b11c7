"""The model plans: the run's tools are offered to it as tools (ChatRequest.tools, each
with the input schema ListTools gives it), the generation service constrains its output
to calls of them, several at once, or an answer, and its calls are the plan.

The conversation it plans from: a short system turn; worked examples as earlier turns,
each with its calls and their results (a 135M model copies a pattern far better than it
follows a description); the session's earlier turns; the question; then this run's
earlier rounds as the assistant's calls and the tools' results, so a later round sees
what came back and may answer instead (stop calling).

A call is used as the model wrote it when it is usable: it names a tool of the run, its
arguments are a JSON object, and every number and code-like name in their text appears
in what the model was shown of this run (the session, the question, earlier results):
SmolLM2-135M invents arguments (python_doc of "math.pi" for "What is 17 * 23?"), and a
made-up argument is no plan. The arguments are not checked against the tool's schema
here: the grammar already holds them to it, and the tools service checks every call
again; a call it refuses fails like any other call, and the next round sees that.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.agent.planner import (
    CALCULATOR,
    GENERATE_IMAGE,
    KNOWLEDGE_SEARCH,
    PYTHON_DOC,
    Observation,
    Tool,
    ToolStep,
)

SYSTEM = (
    "You answer questions about Python and arithmetic. Call the tools the question needs, "
    "with arguments taken from the conversation; once their results are in, answer."
)
# Of each tool result, what a later round is shown: enough to see what came back, while
# the whole conversation stays well inside the model's 2048-token context.
RESULT_CHARS = 300
# Runs of the characters numbers and code names are written in; linear to scan.
WORD = re.compile(r"[\w.]+")


@dataclass(frozen=True)
class ModelCall:
    """One tool call the model made, as the generation service reports it: its arguments
    are the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Example:
    """A worked turn: the question, its calls, each call's result, the answer."""

    question: str
    calls: tuple[tuple[str, dict[str, Any]], ...]
    results: tuple[str, ...]
    answer: str


EXAMPLES = (
    Example("What is 12*7+3?", ((CALCULATOR, {"expression": "12*7+3"}),), ("87",), "87."),
    Example("Double that.", ((CALCULATOR, {"expression": "87*2"}),), ("174",), "174."),
    Example(
        "How do I sort a dictionary by its values?",
        ((KNOWLEDGE_SEARCH, {"query": "How do I sort a dictionary by its values?"}),),
        ("[sorted] sorted(iterable, /, *, key=None, reverse=False)",),
        "Use sorted(d.items(), key=lambda item: item[1]) [sorted].",
    ),
    Example(
        "What does os.path.join do?",
        ((PYTHON_DOC, {"name": "os.path.join"}),),
        ("os.path.join(path, *paths): join one or more path segments.",),
        "It joins path segments into one path [os.path.join].",
    ),
    Example("Draw the digit 5", ((GENERATE_IMAGE, {"prompt": "5"}),), ("1 image",), "Done."),
    Example(
        "What is 2^8 - 1, and what does json.dumps do?",
        ((CALCULATOR, {"expression": "2^8 - 1"}), (PYTHON_DOC, {"name": "json.dumps"})),
        ("255", "json.dumps(obj): serialize obj to a JSON formatted str."),
        "2^8 - 1 = 255, and json.dumps turns an object into JSON text [json.dumps].",
    ),
    Example("Hello!", (), (), "Hello! Ask me about Python or arithmetic."),
)


def _calls_turn(calls: Sequence[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """An assistant turn that makes (id, name, arguments) calls."""
    made = [{"id": i, "name": n, "arguments": json.dumps(a)} for i, n, a in calls]
    return {"role": "assistant", "content": "", "tool_calls": made}


def _examples(tools: Mapping[str, Tool]) -> Iterator[dict[str, Any]]:
    """The examples' turns, each example whose tools are all this run's."""
    for k, example in enumerate(EXAMPLES, start=1):
        if any(name not in tools for name, _ in example.calls):
            continue
        yield {"role": "user", "content": example.question}
        if example.calls:
            ids = [f"example{k}.{j}" for j in range(1, len(example.calls) + 1)]
            yield _calls_turn([(i, n, a) for i, (n, a) in zip(ids, example.calls, strict=True)])
            for i, result in zip(ids, example.results, strict=True):
                yield {"role": "tool", "tool_call_id": i, "content": result}
        yield {"role": "assistant", "content": example.answer}


def _rounds(observations: Sequence[Observation]) -> Iterator[dict[str, Any]]:
    """This run's calls so far, round by round: the calls, then their results."""
    rounds: dict[str, list[tuple[str, Observation]]] = {}
    for k, observation in enumerate(observations):
        call_id = observation.call_id or f"call{k}"
        rounds.setdefault(call_id.partition(".")[0], []).append((call_id, observation))
    for made in rounds.values():
        yield _calls_turn([(i, o.step.name, o.step.arguments) for i, o in made])
        for call_id, observation in made:
            text = observation.text[:RESULT_CHARS]
            content = f"error: {text}" if observation.is_error else text
            yield {"role": "tool", "tool_call_id": call_id, "content": content}


def messages(
    question: str,
    tools: Mapping[str, Tool],
    history: Sequence[tuple[str, str]] = (),
    observations: Sequence[Observation] = (),
) -> tuple[list[dict[str, Any]], str]:
    """The conversation the model plans from, and the text of it that is this run's
    (the session, the question, the calls and results so far: what arguments must come
    from)."""
    earlier = [
        {"role": role, "content": content}
        for asked, answered in history
        for role, content in (("user", asked), ("assistant", answered))
    ]
    run = [*earlier, {"role": "user", "content": question}, *_rounds(observations)]
    shown = "\n".join(
        [m["content"] for m in run] + [c["arguments"] for m in run for c in m.get("tool_calls", ())]
    )
    return [{"role": "system", "content": SYSTEM}, *_examples(tools), *run], shown


def _texts(value: Any) -> Iterator[str]:
    """Every string in a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _texts(item)


def _words(text: str) -> set[str]:
    """The words of `text`; a sentence's final dot is not part of one."""
    return {w.rstrip(".") for w in WORD.findall(text)}


def _literals(text: str) -> set[str]:
    """The words of `text` that are numbers or code names (a digit, an underscore or an
    inner dot): what a model can only have read or made up."""
    return {w for w in _words(text) if "." in w or "_" in w or any(c.isdigit() for c in w)}


def made_up(arguments: dict[str, Any], shown: str) -> list[str]:
    """The numbers and code names in the arguments' text that `shown` does not hold."""
    return sorted({w for t in _texts(arguments) for w in _literals(t)} - _words(shown))


def _problem(call: ModelCall, tools: Mapping[str, Tool], shown: str) -> tuple[str, dict]:
    """Why the call is unusable ("" when it is usable), and its arguments."""
    if call.name not in tools:
        return "it names no tool of this run", {}
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return "its arguments are not JSON (cut short?)", {}
    if not isinstance(arguments, dict):
        return "its arguments are not a JSON object", {}
    invented = made_up(arguments, shown)
    if invented:
        return f"{', '.join(invented)[:64]} appears nowhere in the conversation", arguments
    return "", arguments


def steps(
    calls: Sequence[ModelCall], tools: Mapping[str, Tool], shown: str
) -> tuple[list[ToolStep], list[str]]:
    """The model's usable calls as steps, and a note for each unusable one."""
    planned, notes = [], []
    for call in calls:
        problem, arguments = _problem(call, tools, shown)
        if problem:
            notes.append(f"the model's call of {call.name[:64]} is unusable: {problem}")
        else:
            planned.append(ToolStep(call.name, arguments, f"{call.name} (the model's call)"))
    return planned, notes
