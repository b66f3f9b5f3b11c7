"""A run's loop state as it is checkpointed after each step: what another replica needs to
go on with the run without repeating what it did (services/agent/runs.py).

JSON (the state is small, nested dicts and strings: the tools' structured results are
JSON already) under a version number, compressed with zlib. Only what the loop reads
back is kept: the observations (the tools' full results), iterations, notes, the
planner and whether the answer fell short; timing and the answer's text are the run's
events and the store's running answer.
"""

from __future__ import annotations

import json
import zlib

from services.agent import loop
from services.agent.planner import Observation, ToolStep

VERSION = 1


def dump(state: loop.RunState) -> bytes:
    body = {
        "v": VERSION,
        "observations": [
            {
                "tool": o.step.name,
                "arguments": o.step.arguments,
                "why": o.step.why,
                "is_error": o.is_error,
                "text": o.text,
                "structured": o.structured,
                "call_id": o.call_id,
            }
            for o in state.observations
        ],
        "iterations": state.iterations,
        "notes": state.notes,
        "planner": state.planner.value,
        "shortfalls": state.shortfalls,
    }
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode())


def load(blob: bytes) -> loop.RunState:
    """The state a checkpoint holds; a version this agent does not know is ValueError."""
    body = json.loads(zlib.decompress(blob))
    if body.get("v") != VERSION:
        raise ValueError(f"checkpoint version {body.get('v')!r}; this agent reads {VERSION}")
    return loop.RunState(
        observations=[
            Observation(
                ToolStep(o["tool"], o["arguments"], o["why"]),
                o["is_error"],
                o["text"],
                o["structured"],
                # Checkpoints from before call ids were kept have none.
                o.get("call_id", ""),
            )
            for o in body["observations"]
        ],
        iterations=body["iterations"],
        notes=body["notes"],
        planner=loop.Planner(body["planner"]),
        shortfalls=body["shortfalls"],
    )
