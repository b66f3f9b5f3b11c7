"""Running a client command (`aimesh generate`, `search`, `imagine`, ...) against the mesh.

Every such command wants the same three things: its calls in one trace that the user can
look up, one deadline budget over all of them, and an RPC failure printed as one line
with its field violations and exit status 1 rather than a traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import typer
from opentelemetry import trace

from mesh import tracing
from mesh.deadline import budget
from mesh.errors import field_violations

T = TypeVar("T")


def run_command(name: str, work: Callable[[], Awaitable[T]], *, timeout_s: float) -> tuple[T, str]:
    """`work()`'s result and the trace id it ran under; exits with status 1 on an RPC error."""
    tracing.configure("aimesh-cli")

    async def traced() -> tuple[T, str]:
        with (
            trace.get_tracer("aimesh.cli").start_as_current_span(f"aimesh {name}"),
            budget(timeout_s),
        ):
            return await work(), tracing.current_trace_id()

    try:
        return asyncio.run(traced())
    except grpc.aio.AioRpcError as error:
        problems = "; ".join(f"{v.field}: {v.description}" for v in field_violations(error))
        typer.echo(f"error: {error.code().name}: {problems or error.details()}", err=True)
        raise typer.Exit(1) from None
