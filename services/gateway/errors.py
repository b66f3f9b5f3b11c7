"""Every failure as OpenAI's error: `{"error": {"message", "type", "param", "code"}}`.

Mapped once, here, from what the gateway can meet: the mesh's gRPC statuses (the code, and
the rich details mesh.errors attaches: BadRequest field violations become `param`,
RetryInfo becomes `Retry-After` and `retry-after-ms`, ErrorInfo's reason becomes `code`),
the request models' validation errors, the gateway's own refusals (keys, scopes, unknown
models, unsupported parameters, bodies too large or too slow) and, last, its own bugs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from mesh import request_id
from mesh.errors import error_info, field_violations, retry_delay_s
from mesh.failures import FieldViolation


def encodable(text: str) -> str:
    """`text` with any lone surrogate written as its escape (`\\ud800`): an error may
    quote what a client sent, and its JSON must still encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    """A refusal as the HTTP API states it; `headers` travel with the response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = encodable(message)
        self.type = type
        self.param = None if param is None else encodable(param)
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str, message: str) -> ApiError:
    """400 for a request the API refuses, naming the parameter."""
    return ApiError(400, f"{param}: {message}", type="invalid_request_error", param=param)


def unsupported(param: str, why: str = "is not supported by this server") -> ApiError:
    return invalid(param, why)


def internal(code: str | None = None) -> ApiError:
    """A failure of the gateway or of the mesh below it: 500, its cause withheld (it may
    describe internals), the request id given so its log lines can be found."""
    return ApiError(
        500,
        f"internal error (request id {request_id.current()})",
        type="server_error",
        code=code,
    )


def model_not_found(model: str, known: Sequence[str]) -> ApiError:
    return ApiError(
        404,
        f"The model {model!r} does not exist; this server has {', '.join(known) or 'none'}",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


# gRPC code -> HTTP status and OpenAI error type. A code not here is this mesh's own
# fault: 500, with its message withheld (it may describe internals).
_TABLE: Mapping[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    # A call the mesh stopped on its side (a drain, an operator): worth retrying.
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def renamed(field: str, params: Mapping[str, str]) -> str:
    """A mesh field path in the API's words: the longest prefix in `params` is replaced,
    what follows it kept (`messages[2].role` stays, `stopping.max_new_tokens` becomes
    `max_tokens`)."""
    for prefix in sorted(params, key=len, reverse=True):
        if field == prefix or field.startswith((prefix + ".", prefix + "[")):
            return params[prefix] + field[len(prefix) :]
    return field


def retry_headers(delay_s: float) -> dict[str, str]:
    """Both headers the openai SDK honours (milliseconds first)."""
    return {
        "retry-after-ms": str(max(1, round(delay_s * 1000))),
        "retry-after": str(max(1, math.ceil(delay_s))),
    }


def from_rpc(error: grpc.aio.AioRpcError, params: Mapping[str, str]) -> ApiError:
    """The one translation of a mesh status; `params` renames the proto's field paths."""
    code = error.code()
    status, kind = _TABLE.get(code, (500, "server_error"))
    info = error_info(error)
    reason = (info.reason if info is not None and info.reason else code.name).lower()
    if status == 500:
        return internal(reason)
    violations = [
        FieldViolation(renamed(v.field, params), v.description) for v in field_violations(error)
    ]
    message = "; ".join(f"{v.field}: {v.description}" for v in violations) or (
        error.details() or code.name
    )
    delay = retry_delay_s(error)
    return ApiError(
        status,
        message,
        # OpenAI's type for a spent quota (its code too); other 429s are rate limits.
        type="insufficient_quota" if reason == "insufficient_quota" else kind,
        param=violations[0].field if violations else None,
        code=reason,
        headers=retry_headers(delay) if delay is not None else None,
    )


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
# Union members pydantic names in a location ("str", "list[str]"): not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def param_of(location: Sequence[int | str]) -> str | None:
    """A validation error's location as a parameter path (`messages[0].role`): the body
    prefix dropped, cut where pydantic starts naming union members instead of fields."""
    path = ""
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD.fullmatch(part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


# Validation errors at the body itself: it was not a JSON object.
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "dict_type", "missing"})


def from_validation(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """FastAPI's RequestValidationError: the first problem names `param` (a validator
    that sees the whole body names it in its error's context)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, "the body is not valid JSON", type="invalid_request_error")
    location = tuple(first.get("loc", ()))
    if location == ("body",) and first.get("type") in _NOT_AN_OBJECT:
        return ApiError(400, "the body must be a JSON object", type="invalid_request_error")
    param = (first.get("ctx") or {}).get("param") or param_of(location)
    message = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return ApiError(
        400,
        f"{param}: {message}{more}" if param else message + more,
        type="invalid_request_error",
        param=param,
    )
