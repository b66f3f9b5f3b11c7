"""Deadline propagation: the caller's budget travels with the request and shrinks per hop.

grpcio does not propagate deadlines (its OSS hook returns None). The server side
records when the incoming call expires in a contextvar (`record`); the client side
(`DeadlinePolicy`) gives every outgoing call min(explicit timeout, remaining budget -
margin), or the method's default when there is no budget at all, so no call ever leaves
without a deadline. Downstream calls are made from the handler's own task, so when the
handler is cancelled (deadline or client cancel) grpc cancels the calls below it too.

What a callee reads from time_remaining() is what arrived on the wire, which grpc rounds
up (and, reusing an HPACK entry, may round up by as much as 3%); the caller's side of the
call keeps the exact deadline and cancels it on time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import grpc

from mesh.config import ClientSettings
from mesh.errors import local_error, status
from mesh.rpc import method_name

# Absolute expiry on the time.monotonic() clock; None means "no budget known".
_expires_at: ContextVar[float | None] = ContextVar("aimesh_deadline", default=None)


def remaining() -> float | None:
    """Seconds left in the current request's budget, or None when it has none."""
    expires_at = _expires_at.get()
    return None if expires_at is None else expires_at - time.monotonic()


@contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Starts (or narrows) a budget for calls made inside the block, e.g. at a CLI edge."""
    current = _expires_at.get()
    expires_at = time.monotonic() + seconds
    token = _expires_at.set(expires_at if current is None else min(current, expires_at))
    try:
        yield
    finally:
        _expires_at.reset(token)


def record(context: grpc.aio.ServicerContext) -> None:
    """Stores the incoming call's deadline for handlers and the calls they make.

    Each RPC runs in its own task with its own context, so the value never leaks between
    calls and needs no reset.
    """
    left = context.time_remaining()
    _expires_at.set(None if left is None else time.monotonic() + left)


class DeadlinePolicy:
    """Gives every outgoing call a deadline derived from the budget it was made under."""

    def __init__(self, client: ClientSettings) -> None:
        self.client = client

    def timeout_for(self, details: grpc.aio.ClientCallDetails, *, streaming: bool) -> float:
        client = self.client
        method = method_name(details)
        left = remaining()
        candidates = [] if details.timeout is None else [details.timeout]
        if left is not None:
            candidates.append(left * (1 - client.deadline_margin_ratio) - client.deadline_margin_s)
        if candidates:
            timeout = min(candidates)
        else:
            fallback = (
                client.default_stream_deadline_s if streaming else client.default_unary_deadline_s
            )
            timeout = client.method_deadlines_s.get(method, fallback)
        if timeout <= 0:
            raise local_error(
                status(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"deadline budget spent before calling {method}",
                    reason="BUDGET_SPENT",
                    metadata={"method": method},
                )
            )
        return timeout
