"""The request id: one id per user request, carried in `x-request-id` across every hop.

A caller may supply it; otherwise the first server generates one. Logs and spans carry
it, so one grep finds a request everywhere, even where tracing is off.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar

import grpc

from mesh.failures import FieldViolation, InvalidInput
from mesh.rpc import incoming

METADATA_KEY = "x-request-id"
_MAX_LENGTH = 128
_PRINTABLE = re.compile(r"[\x21-\x7e]*")

_request_id: ContextVar[str] = ContextVar("aimesh_request_id", default="")
# True while the id was made up here rather than given by a caller.
_generated: ContextVar[bool] = ContextVar("aimesh_request_id_generated", default=False)


def current() -> str:
    return _request_id.get()


RULE = f"must be at most {_MAX_LENGTH} printable ASCII characters (0x21-0x7e)"


def is_valid(request_id: str) -> bool:
    """Whether a body's request id can travel on: ids go out in gRPC metadata, whose
    values are printable ASCII, and into every log line, so they stay short."""
    return len(request_id) <= _MAX_LENGTH and _PRINTABLE.fullmatch(request_id) is not None


def check(request_id: str, field: str = "request_id") -> None:
    """InvalidInput naming `field` unless `is_valid(request_id)`."""
    if not is_valid(request_id):
        raise InvalidInput([FieldViolation(field, RULE)])


def ensure(request_id: str = "") -> str:
    """The current request's id. An id given in a request body (`request_id` fields)
    replaces one this server made up, but never one the caller sent in metadata; one
    that could not travel on is refused (InvalidInput on `request_id`)."""
    check(request_id)
    existing = _request_id.get()
    if request_id and (not existing or _generated.get()):
        _request_id.set(request_id)
        _generated.set(False)
    elif not existing:
        _request_id.set(os.urandom(16).hex())
        _generated.set(True)
    return _request_id.get()


def adopt(context: grpc.aio.ServicerContext) -> None:
    """Takes the caller's id from metadata, or starts a new one, for this call's task."""
    given = incoming(context, METADATA_KEY, _MAX_LENGTH)
    _request_id.set(os.urandom(16).hex() if given is None else given)
    _generated.set(given is None)
