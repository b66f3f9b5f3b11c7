"""The agent on labelled questions: answer accuracy and citation precision, one run.

34 questions (loadtest/data/agent_questions.jsonl): 22 from the stdlib question set, each
labelled with the passage ids that answer it, and 12 arithmetic questions with their
values. Then 8 two-turn sessions (loadtest/data/agent_sessions.jsonl): an arithmetic
question, then a follow-up that needs its answer ("Add 100 to that."), labelled with the
follow-up's value. The whole mesh runs as `aimesh up` (every service its own process, the default
stdlib knowledge base ingested first, unchanged passages skipped), and each question is
one Run with a fixed seed, greedy decoding and the default answer length.

- number questions: the answer is right when a number in its text equals the value
  (relative tolerance 1e-9); the calculator column says whether the tool computed it.
- cite questions: citation precision is the share of cited ids that are labelled
  relevant; "hit" is a question where at least one cited id is relevant.
- sessions: each in a session of its own (a fresh id per run of this script); a
  follow-up is right as a number question is.

    python -m loadtest.agent_eval --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from loadtest.mesh_overhead import write
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from mesh.registry import discover

QUESTIONS = Path(__file__).parent / "data" / "agent_questions.jsonl"
SESSIONS = Path(__file__).parent / "data" / "agent_sessions.jsonl"
BEGIN, END = "<!-- agent:begin -->", "<!-- agent:end -->"
COMMAND = "python -m loadtest.agent_eval --out docs/benchmarks.md"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class Outcome:
    question: dict
    answer: str
    citations: list[str]
    tools: list[str]
    calculator_value: float | None
    seconds: float
    by_model: bool  # the model planned (no iteration fell back to the rules)
    # Seconds per kind of hop, from Final.timing: "plan", "answer", "tools" (every tool
    # call together).
    stages: dict[str, float]
    completion_tokens: int
    notes: list[str]


def numbers_in(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in NUMBER.findall(text)]


def right_number(outcome: Outcome) -> bool:
    expected = outcome.question["number"]
    return any(math.isclose(n, expected, rel_tol=1e-9) for n in numbers_in(outcome.answer))


def precision(outcome: Outcome) -> float:
    cited = outcome.citations
    relevant = set(outcome.question["cite"])
    return sum(c in relevant for c in cited) / len(cited) if cited else 0.0


async def ask(stub, question: dict, session_id: str = "") -> Outcome:
    request = agent_pb2.RunRequest(
        question=question["question"], options=agent_pb2.RunOptions(seed=1), session_id=session_id
    )
    answer, citations, tools, value, by_model = "", [], [], None, False
    stages: dict[str, float] = {}
    completion_tokens, notes = 0, []
    started = time.perf_counter()
    async for event in stub.Run(request, timeout=120):
        kind = event.WhichOneof("event")
        if kind == "answer_delta":
            answer += event.answer_delta.text
        elif kind == "citations":
            citations = list(event.citations.passage_ids)
        elif kind == "final":
            by_model = event.final.planner == agent_pb2.PLANNER_LLM
            completion_tokens = event.final.usage.completion_tokens
            notes = list(event.final.notes)
            for hop in event.final.timing.stages:
                name = hop.name if hop.name in ("plan", "answer") else "tools"
                stages[name] = stages.get(name, 0.0) + hop.duration_ns / 1e9
        elif kind == "tool_result":
            tools.append(event.tool_result.name)
            if event.tool_result.name == "calculator" and not event.tool_result.is_error:
                value = json_format.MessageToDict(event.tool_result.structured)["value"]
    seconds = time.perf_counter() - started
    return Outcome(
        question,
        answer,
        citations,
        tools,
        value,
        seconds,
        by_model,
        stages,
        completion_tokens,
        notes,
    )


async def follow_up(stub, session: dict, session_id: str) -> Outcome:
    """The session's follow-up, asked after its first question in the same session."""
    first, then = session["turns"]
    await ask(stub, {"question": first}, session_id)
    return await ask(stub, {"question": then, "number": session["number"]}, session_id)


async def evaluate(target: str) -> tuple[list[Outcome], list[Outcome]]:
    """The questions' outcomes, and the sessions' follow-ups'."""
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    sessions = [json.loads(line) for line in SESSIONS.read_text().splitlines()]
    prefix = f"eval-{uuid.uuid4().hex[:8]}"
    async with create_channel(target, MeshSettings()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        outcomes = [await ask(stub, question) for question in questions]
        follow_ups = [
            await follow_up(stub, session, f"{prefix}-{k}") for k, session in enumerate(sessions)
        ]
    return outcomes, follow_ups


def computed(outcome: Outcome) -> bool:
    """The calculator computed the labelled value."""
    value = outcome.calculator_value
    return value is not None and math.isclose(value, outcome.question["number"], rel_tol=1e-9)


def report(outcomes: list[Outcome], follow_ups: list[Outcome]) -> str:
    numbers = [o for o in outcomes if "number" in o.question]
    cites = [o for o in outcomes if "cite" in o.question]
    tool_right = [o for o in numbers if computed(o)]
    hits = [o for o in cites if precision(o) > 0]
    lines = [
        BEGIN,
        "## Agent: answer accuracy and citation precision on labelled questions",
        "",
        f"`{COMMAND}`: {len(outcomes)} questions and {len(follow_ups)} two-turn sessions through"
        " `aimesh up` (SmolLM2-135M plans with tool calls and answers, default stdlib"
        " knowledge base), one run, seed 1, greedy.",
        "",
        "| questions | measure | result |",
        "|---|---|---:|",
        f"| {len(numbers)} arithmetic | answer states the right value | "
        f"{sum(map(right_number, numbers))}/{len(numbers)} |",
        f"| | calculator computed the right value | {len(tool_right)}/{len(numbers)} |",
        f"| {len(cites)} knowledge base | citation precision (mean) | "
        f"{statistics.mean(map(precision, cites)):.2f} |",
        f"| | at least one relevant passage cited | {len(hits)}/{len(cites)} |",
        f"| all | planned by the model (no fallback to rules) | "
        f"{sum(o.by_model for o in outcomes)}/{len(outcomes)} |",
        f"| | latency p50 / max | {statistics.median(o.seconds for o in outcomes):.1f} s"
        f" / {max(o.seconds for o in outcomes):.1f} s |",
        "| | p50 of planning / tools / answering | "
        + " / ".join(
            f"{statistics.median(o.stages.get(name, 0.0) for o in outcomes):.2f} s"
            for name in ("plan", "tools", "answer")
        )
        + " |",
        f"| | generated tokens per run, p50 | "
        f"{statistics.median(o.completion_tokens for o in outcomes):.0f} |",
        f"| {len(follow_ups)} follow-ups | answer states the right value | "
        f"{sum(map(right_number, follow_ups))}/{len(follow_ups)} |",
        f"| | calculator computed the right value | "
        f"{sum(map(computed, follow_ups))}/{len(follow_ups)} |",
        f"| | planned by the model | {sum(o.by_model for o in follow_ups)}/{len(follow_ups)} |",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="aimesh-agent-eval-"))
    aimesh = Path(sys.executable).parent / "aimesh"
    env = {**os.environ, "AIMESH_LOG_LEVEL": "WARNING", "GRPC_VERBOSITY": "ERROR"}
    mesh = subprocess.Popen(
        [str(aimesh), "up", "--log-dir", str(logs)], env=env, stdout=subprocess.DEVNULL
    )
    settings = MeshSettings()
    specs = discover()
    target = settings.target_of("agent", specs["agent"].default_port)
    try:
        for name, spec in specs.items():
            address = settings.target_of(name, spec.default_port)
            if not asyncio.run(wait_until_serving(address, name, timeout_s=300)):
                raise SystemExit(f"{name} did not start; logs in {logs}")
        subprocess.run([str(aimesh), "ingest"], env=env, check=True)
        outcomes, follow_ups = asyncio.run(evaluate(target))
    finally:
        mesh.send_signal(signal.SIGTERM)
        mesh.wait(timeout=60)
    for outcome in [*outcomes, *follow_ups]:
        print(json.dumps({**outcome.question, "answer": outcome.answer[:200],
                          "citations": outcome.citations, "tools": outcome.tools,
                          "by_model": outcome.by_model, "notes": outcome.notes}))  # fmt: skip
    markdown = report(outcomes, follow_ups)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
