"""Failures an engine can raise, with no dependency on grpc.

Engines (model code, schedulers) raise these; `mesh.errors` is the one place that turns
them into gRPC statuses, so engine code never imports grpc and never invents its own codes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class Failure(Exception):
    """Base of every expected failure; `reason` becomes ErrorInfo.reason (UPPER_SNAKE_CASE)."""

    reason: str = "FAILURE"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason


@dataclass(frozen=True)
class FieldViolation:
    """One bad field: `field` is a path such as `messages[2].content`."""

    field: str
    description: str


class InvalidInput(Failure):
    """The request itself is wrong; retrying it unchanged cannot succeed."""

    reason = "INVALID_INPUT"

    def __init__(self, violations: Iterable[FieldViolation], message: str | None = None) -> None:
        self.violations = tuple(violations)
        summary = "; ".join(f"{v.field}: {v.description}" for v in self.violations)
        super().__init__(message or summary or "invalid request")


class Overloaded(Failure):
    """No capacity now; the caller should come back after `retry_after_s`."""

    reason = "OVERLOADED"

    def __init__(self, message: str, *, retry_after_s: float, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class QuotaExceeded(Failure):
    """A tenant is past one of its limits (mesh/metering.py): RESOURCE_EXHAUSTED about
    that tenant alone, never about the server's capacity, so no circuit breaker holds
    other callers back for it. `retry_after_s` is when a bucket will have room; None when
    waiting cannot help (a spent budget, a request larger than the bucket)."""

    reason = "RATE_LIMIT_EXCEEDED"

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        retry_after_s: float | None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s
        self.metadata = dict(metadata or {})


# QuotaExceeded's reasons, as OpenAI names the same refusals: a bucket that will refill,
# a request larger than the bucket, a spent budget.
QUOTA_REASONS = frozenset({"RATE_LIMIT_EXCEEDED", "REQUEST_TOO_LARGE", "INSUFFICIENT_QUOTA"})


class NotReady(Failure):
    """The engine cannot serve yet (model loading, warming up) or any more (draining)."""

    reason = "NOT_READY"


class OutOfMemory(Failure):
    """A request did not fit in memory; the engine freed what it took and keeps serving.

    `retry_after_s` is None for a request that can never fit (no RetryInfo is sent).
    """

    reason = "OUT_OF_MEMORY"

    def __init__(
        self, message: str, *, retry_after_s: float | None = 1.0, reason: str | None = None
    ) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class NotFound(Failure):
    """A named thing (model, collection, KV handle, job) does not exist."""

    reason = "NOT_FOUND"

    def __init__(self, message: str, *, resource_type: str, resource_name: str) -> None:
        super().__init__(message)
        self.resource_type = resource_type
        self.resource_name = resource_name


class AlreadyExists(Failure):
    """Something with this name exists and differs from what the request asks for."""

    reason = "ALREADY_EXISTS"


class Cancelled(Failure):
    """The work was stopped on purpose, e.g. by a cancel call from another connection."""

    reason = "CANCELLED"


class Conflict(Failure):
    """The request is valid but the target's state does not allow it (FAILED_PRECONDITION)."""

    reason = "CONFLICT"


class Unauthenticated(Failure):
    """The caller did not say who it is (no client certificate naming a mesh identity)."""

    reason = "UNAUTHENTICATED"


class PermissionDenied(Failure):
    """The caller is known and not allowed to call this method (mesh/authz.py);
    `metadata` (caller, method) goes into ErrorInfo."""

    reason = "PERMISSION_DENIED"

    def __init__(
        self, message: str, *, reason: str | None = None, metadata: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, reason=reason)
        self.metadata = dict(metadata or {})
