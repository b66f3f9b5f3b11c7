"""The answer prompt: the question, what the tools found (passages with their ids), and
what they could not do, so a small model answers from evidence and cites it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from services.agent.planner import CALCULATOR, GENERATE_IMAGE, Observation

SYSTEM = (
    "You answer questions about Python and arithmetic. Use only the evidence given. "
    "When you use a passage, cite its id in square brackets, like [json.loads]. "
    "If the evidence does not answer the question, say so briefly."
)
CITATION = re.compile(r"\[([^\[\]\s]{1,200})\]")


def passages(observations: list[Observation]) -> list[dict]:
    """Every passage the tools returned, best first, each id once. Structured content is
    another service's output, checked by nobody on the way: what is not a passage (a string
    id and text) is skipped, so a malformed result costs evidence, not the answer."""
    found: dict[str, dict] = {}
    for observation in observations:
        if observation.is_error:
            continue
        structured = observation.structured
        listed = structured.get("passages")
        ids = structured.get("passage_ids")
        candidates = listed if isinstance(listed, list) else []
        if isinstance(ids, list) and ids:
            candidates = [*candidates, {"id": ids[0], "text": structured.get("text")}]
        for passage in candidates:
            if is_passage(passage):
                found.setdefault(passage["id"], passage)
    return list(found.values())


def is_passage(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(k), str) for k in ("id", "text"))


def finds_passages(observation: Observation) -> bool:
    """Whether the tool answers in passages (knowledge_search, python_doc): those are
    shown as passages with their ids; any other tool's result (the calculator's, an
    image's, a mounted MCP server's) as its text."""
    return any(key in observation.structured for key in ("passages", "passage_ids"))


def evidence(observations: list[Observation], limit: int, chars: int = 600) -> str:
    lines = [
        f"{o.step.name} failed: {o.text}" if o.is_error else f"{o.step.name}: {o.text[:chars]}"
        for o in observations
        if o.is_error or not finds_passages(o)
    ]
    lines += [f"[{p['id']}] {p['text'][:chars]}" for p in passages(observations)[:limit]]
    return "\n\n".join(lines) or "(no evidence: every tool failed or none applied)"


def answer_messages(
    question: str,
    observations: list[Observation],
    limit: int,
    history: Sequence[tuple[str, str]] = (),
) -> list[dict]:
    """The system prompt, the session's earlier turns as the conversation they were, then
    this question with its evidence."""
    prompt = f"Evidence:\n{evidence(observations, limit)}\n\nQuestion: {question}"
    earlier = [
        message
        for asked, answered in history
        for message in (
            {"role": "user", "content": asked},
            {"role": "assistant", "content": answered},
        )
    ]
    return [{"role": "system", "content": SYSTEM}, *earlier, {"role": "user", "content": prompt}]


def cited(answer: str, observations: list[Observation], limit: int) -> list[str]:
    """The passages the answer used, as far as the text shows: those it cites as [id];
    failing that, those whose name it mentions (e.g. `shutil.rmtree`); failing that, the
    best-ranked passage its prompt carried, the one it most likely drew on."""
    known = [p["id"] for p in passages(observations)[:limit]]
    named = [i for i in dict.fromkeys(CITATION.findall(answer)) if i in known]
    if named:
        return named
    mentioned = [i for i in known if name_of(i) in answer]
    return mentioned or known[:1]


def name_of(passage_id: str) -> str:
    """`json.loads#2` -> `json.loads`; `topic:with` -> `with`."""
    return passage_id.partition("#")[0].removeprefix("topic:")


def fallback_answer(observations: list[Observation]) -> str:
    """What the agent says when generation failed: the evidence itself, plainly."""
    useful = [o for o in observations if not o.is_error]
    if not useful:
        return "I could not answer: every tool I tried failed or ran out of time."
    parts = [
        (
            f"The calculator gives {o.text}."
            if o.step.name == CALCULATOR
            else f"{o.step.name}: {o.text}"
        )
        for o in useful
        if o.step.name != GENERATE_IMAGE and not finds_passages(o)
    ]
    found = passages(useful)
    if found:
        parts.append(
            "The most relevant documentation: "
            + "; ".join(f"[{p['id']}] {(p['text'].splitlines() or [''])[0]}" for p in found[:3])
        )
    return " ".join(parts) or "The tools returned nothing I can answer from."
