"""The one table from failures to gRPC statuses, and rich-status helpers (grpcio-status).

Every status aimesh sends carries a google.rpc.Status in `grpc-status-details-bin`:
ErrorInfo (reason, domain "aimesh") always, BadRequest field violations for
INVALID_ARGUMENT, RetryInfo whenever retrying later can help, ResourceInfo for NOT_FOUND.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mesh.failures import (
    AlreadyExists,
    Cancelled,
    Conflict,
    Failure,
    FieldViolation,
    InvalidInput,
    NotFound,
    NotReady,
    OutOfMemory,
    Overloaded,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
)

DOMAIN = "aimesh"
DETAILS_KEY = "grpc-status-details-bin"
# Trailer on a status a service passes up from a dependency: the service answered, so its
# callers' breakers must not count the failure against it (see mesh.breaker).
PASSED_THROUGH_KEY = "aimesh-passed-through"

log = logging.getLogger(__name__)

# Failure type -> code. Order matters only for subclasses; these are all distinct.
FAILURE_CODES: Mapping[type[Failure], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    OutOfMemory: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    Cancelled: grpc.StatusCode.CANCELLED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

# A dependency's failure that the handler did not handle: these codes mean the same thing
# one hop up (and keep their RetryInfo); anything else is this service's internal error.
PASS_THROUGH_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)


# A status travels in trailing metadata, which grpc caps (16 KiB by default): a refusal
# that quoted a huge input back would itself fail (RESOURCE_EXHAUSTED, not the answer).
# Limits in UTF-8 bytes; the message travels twice (grpc-message and inside the details).
MAX_MESSAGE_BYTES = 1024
MAX_VIOLATIONS = 10
MAX_FIELD_BYTES = 128
MAX_DESCRIPTION_BYTES = 256


def clipped(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, on a character boundary, marked with …"""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "…"


def status(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    metadata: Mapping[str, str] | None = None,
    violations: Iterable[FieldViolation] = (),
    retry_after_s: float | None = None,
    resource: tuple[str, str] | None = None,
) -> grpc.Status:
    """Builds a grpc.Status whose trailing metadata holds the rich google.rpc.Status."""
    details = [
        error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata or {}))
    ]
    bad = list(violations)
    if bad:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=clipped(v.field, MAX_FIELD_BYTES),
                        description=clipped(v.description, MAX_DESCRIPTION_BYTES),
                    )
                    for v in bad[:MAX_VIOLATIONS]
                ]
            )
        )
    message = clipped(message, MAX_MESSAGE_BYTES)
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(max(retry_after_s, 0.0) * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    if resource is not None:
        details.append(
            error_details_pb2.ResourceInfo(resource_type=resource[0], resource_name=resource[1])
        )
    proto = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        proto.details.add().Pack(detail)
    return rpc_status.to_status(proto)


def status_for_failure(failure: Failure) -> grpc.Status:
    """The table: an engine failure becomes exactly one status; a subclass of a failure in
    the table (e.g. a service's own NotFound) gets its nearest ancestor's code."""
    code = next(
        (FAILURE_CODES[kind] for kind in type(failure).__mro__ if kind in FAILURE_CODES),
        grpc.StatusCode.INTERNAL,
    )
    return status(
        code,
        failure.message,
        reason=failure.reason,
        metadata=getattr(failure, "metadata", None),
        violations=getattr(failure, "violations", ()),
        retry_after_s=getattr(failure, "retry_after_s", None),
        resource=(
            (failure.resource_type, failure.resource_name)
            if isinstance(failure, NotFound)
            else None
        ),
    )


class _Status(
    collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status
):
    """A grpc.Status with trailers of our choosing (grpcio-status builds only its own)."""


def status_for_dependency(error: grpc.aio.AioRpcError) -> grpc.Status:
    """A downstream call failed and the handler let it escape: a code that means the same
    one hop up keeps its rich status and is marked as passed through."""
    code = error.code()
    if code in PASS_THROUGH_CODES:
        proto = rich_status(error)
        result = (
            rpc_status.to_status(proto)
            if proto is not None
            else status(code, error.details() or code.name, reason=f"DEPENDENCY_{code.name}")
        )
        return _Status(
            result.code,
            result.details,
            (*result.trailing_metadata, (PASSED_THROUGH_KEY, "1")),
        )
    return status(
        grpc.StatusCode.INTERNAL,
        f"a dependency failed with {code.name}: {error.details()}",
        reason="DEPENDENCY_FAILED",
        metadata={"dependency_code": code.name},
    )


async def abort(context: grpc.aio.ServicerContext, result: grpc.Status) -> NoReturn:
    """Ends the call with `result`; raises grpc.aio.AbortError like context.abort."""
    await context.abort(result.code, result.details, result.trailing_metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover


def internal_status(exc: BaseException) -> grpc.Status:
    return status(
        grpc.StatusCode.INTERNAL,
        f"internal error: {type(exc).__name__}",
        reason="INTERNAL",
    )


async def fail(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> NoReturn:
    """Ends the call with the status the table gives `exc`; logs what is a bug."""
    if isinstance(exc, Failure):
        await abort(context, status_for_failure(exc))
    if isinstance(exc, grpc.aio.AioRpcError):
        await abort(context, status_for_dependency(exc))
    log.exception("unhandled error in %s", method)
    await abort(context, internal_status(exc))


# ---- client side: reading rich statuses and failing locally ----


def rich_status(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for key, value in error.trailing_metadata() or ():
        if key == DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None


def _unpack(error: grpc.aio.AioRpcError, message_type: type) -> Any | None:
    proto = rich_status(error)
    if proto is None:
        return None
    for detail in proto.details:
        if detail.Is(message_type.DESCRIPTOR):
            message = message_type()
            detail.Unpack(message)
            return message
    return None


def passed_through(error: grpc.aio.AioRpcError) -> bool:
    """Whether the target answered with a failure it passed up from its own dependency."""
    return any(key == PASSED_THROUGH_KEY for key, _ in error.trailing_metadata() or ())


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    return _unpack(error, error_details_pb2.ErrorInfo)


def field_violations(error: grpc.aio.AioRpcError) -> list[FieldViolation]:
    bad = _unpack(error, error_details_pb2.BadRequest)
    if bad is None:
        return []
    return [FieldViolation(v.field, v.description) for v in bad.field_violations]


def retry_delay_s(error: grpc.aio.AioRpcError) -> float | None:
    info = _unpack(error, error_details_pb2.RetryInfo)
    return None if info is None else info.retry_delay.ToNanoseconds() / 1e9


def local_error(result: grpc.Status) -> grpc.aio.AioRpcError:
    """An AioRpcError for a call the client refuses to send (open breaker, spent budget)."""
    return grpc.aio.AioRpcError(
        result.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*result.trailing_metadata),
        details=result.details,
    )
