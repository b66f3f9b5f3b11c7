"""Building the aimesh.common.v1 Timing every response ends with (TEI's Metadata, Qdrant's
`time`): named stages of queue, compute, transfer or call time, in nanoseconds."""

from __future__ import annotations

from aimesh.common.v1 import common_pb2


def stage(
    name: str, seconds: float, kind: int, service: str = "", tokens: int = 0
) -> common_pb2.Stage:
    """A stage of `seconds` (clamped at 0: clocks of different hops can disagree)."""
    return common_pb2.Stage(
        name=name,
        kind=kind,
        duration_ns=int(max(seconds, 0.0) * 1e9),
        service=service,
        tokens=tokens,
    )


def timing_ms(timing: common_pb2.Timing) -> dict[str, float]:
    """A Timing as {stage: ms, ..., "total": ms}, the shape the CLIs print as JSON."""
    stages = {s.name: round(s.duration_ns / 1e6, 2) for s in timing.stages}
    return {**stages, "total": round(timing.total_ns / 1e6, 2)}
