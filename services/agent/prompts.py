"""The answer prompt: the question, what the tools found (passages with their ids), and
what they could not do, so a small model answers from evidence and cites it."""

from __future__ import annotations

import re

from services.agent.planner import Observation

SYSTEM = (
    "You answer questions about Python and arithmetic. Use only the evidence given. "
    "When you use a passage, cite its id in square brackets, like [json.loads]. "
    "If the evidence does not answer the question, say so briefly."
)
CITATION = re.compile(r"\[([^\[\]\s]{1,200})\]")


def passages(observations: list[Observation]) -> list[dict]:
    """Every passage the tools returned, best first, each id once."""
    found: dict[str, dict] = {}
    for observation in observations:
        if observation.is_error:
            continue
        for passage in observation.structured.get("passages", []):
            found.setdefault(passage["id"], passage)
        if "passage_ids" in observation.structured:
            ids = observation.structured["passage_ids"]
            found.setdefault(ids[0], {"id": ids[0], "text": observation.structured["text"]})
    return list(found.values())


def evidence(observations: list[Observation], limit: int, chars: int = 600) -> str:
    lines = []
    for observation in observations:
        if observation.step.name in ("calculator", "generate_image") and not observation.is_error:
            lines.append(f"{observation.step.name}: {observation.text}")
        elif observation.is_error:
            lines.append(f"{observation.step.name} failed: {observation.text}")
    for passage in passages(observations)[:limit]:
        lines.append(f"[{passage['id']}] {passage['text'][:chars]}")
    return "\n\n".join(lines) or "(no evidence: every tool failed or none applied)"


def answer_messages(question: str, observations: list[Observation], limit: int) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Evidence:\n{evidence(observations, limit)}\n\nQuestion: {question}",
        },
    ]


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
    parts = []
    for observation in useful:
        if observation.step.name == "calculator":
            parts.append(f"The calculator gives {observation.text}.")
    found = passages(useful)
    if found:
        parts.append(
            "The most relevant documentation: "
            + "; ".join(f"[{p['id']}] {p['text'].splitlines()[0]}" for p in found[:3])
        )
    return " ".join(parts) or "The tools returned nothing I can answer from."
