"""The one failure -> status table and the rich details every status carries."""

from __future__ import annotations

import grpc
import pytest

from mesh import errors
from mesh.failures import (
    AlreadyExists,
    Cancelled,
    Conflict,
    FieldViolation,
    InvalidInput,
    NotFound,
    NotReady,
    OutOfMemory,
    Overloaded,
)
from mesh.validation import Violations

pytestmark = pytest.mark.service


def _as_error(status: grpc.Status) -> grpc.aio.AioRpcError:
    return errors.local_error(status)


@pytest.mark.parametrize(
    ("failure", "code", "reason"),
    [
        (
            InvalidInput([FieldViolation("prompt", "must not be empty")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT",
        ),
        (Overloaded("busy", retry_after_s=0.25), grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED"),
        (OutOfMemory("batch too large"), grpc.StatusCode.RESOURCE_EXHAUSTED, "OUT_OF_MEMORY"),
        (NotReady("model loading"), grpc.StatusCode.UNAVAILABLE, "NOT_READY"),
        (
            NotFound("no such model", resource_type="model", resource_name="x"),
            grpc.StatusCode.NOT_FOUND,
            "NOT_FOUND",
        ),
        (Conflict("job already finished"), grpc.StatusCode.FAILED_PRECONDITION, "CONFLICT"),
        (AlreadyExists("collection differs"), grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS"),
        (Cancelled("job cancelled"), grpc.StatusCode.CANCELLED, "CANCELLED"),
    ],
)
def test_every_failure_maps_to_one_code_with_error_info(failure, code, reason):
    error = _as_error(errors.status_for_failure(failure))
    assert error.code() == code
    assert error.details() == failure.message
    info = errors.error_info(error)
    assert (info.reason, info.domain) == (reason, "aimesh")


def test_invalid_input_carries_field_violations():
    violations = Violations()
    violations.in_range(float("nan"), "sampling.temperature", 0, 2)
    violations.in_range(-1, "stopping.max_new_tokens", 1, 4096)
    violations.max_length("x" * 10, "prompt", 5)
    with pytest.raises(InvalidInput) as caught:
        violations.raise_if_any()
    error = _as_error(errors.status_for_failure(caught.value))
    assert [v.field for v in errors.field_violations(error)] == [
        "sampling.temperature",
        "stopping.max_new_tokens",
        "prompt",
    ]
    assert "finite" in errors.field_violations(error)[0].description


def test_no_violations_raise_nothing():
    violations = Violations()
    violations.in_range(1.0, "x", 0, 2)
    violations.raise_if_any()
    assert not violations


def test_overload_and_oom_say_when_to_retry():
    assert errors.retry_delay_s(
        _as_error(errors.status_for_failure(Overloaded("busy", retry_after_s=0.25)))
    ) == pytest.approx(0.25)
    assert errors.retry_delay_s(_as_error(errors.status_for_failure(OutOfMemory("oom")))) > 0


def test_a_request_that_can_never_fit_carries_no_retry_hint():
    never = OutOfMemory("4 GiB job, 1 GiB budget", retry_after_s=None, reason="JOB_TOO_LARGE")
    error = _as_error(errors.status_for_failure(never))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.retry_delay_s(error) is None
    assert errors.error_info(error).reason == "JOB_TOO_LARGE"


def test_a_subclass_of_a_known_failure_keeps_its_code():
    class ToolTooSlow(Overloaded):
        reason = "TOOL_TOO_SLOW"

    error = _as_error(errors.status_for_failure(ToolTooSlow("busy", retry_after_s=1.0)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.error_info(error).reason == "TOOL_TOO_SLOW"


def test_not_found_names_the_resource():
    error = _as_error(
        errors.status_for_failure(
            NotFound("unknown collection", resource_type="collection", resource_name="docs")
        )
    )
    assert errors.rich_status(error).details[1].type_url.endswith("google.rpc.ResourceInfo")


def test_dependency_failures_pass_through_or_become_internal():
    unavailable = _as_error(errors.status_for_failure(NotReady("loading")))
    passed = errors.status_for_dependency(unavailable)
    assert passed.code == grpc.StatusCode.UNAVAILABLE
    assert errors.error_info(_as_error(passed)).reason == "NOT_READY"
    assert errors.passed_through(_as_error(passed))
    assert not errors.passed_through(unavailable)

    bad = _as_error(errors.status_for_failure(InvalidInput([FieldViolation("x", "bad")])))
    hidden = errors.status_for_dependency(bad)
    assert hidden.code == grpc.StatusCode.INTERNAL
    info = errors.error_info(_as_error(hidden))
    assert info.reason == "DEPENDENCY_FAILED"
    assert info.metadata["dependency_code"] == "INVALID_ARGUMENT"


def test_unexpected_exceptions_become_internal_without_leaking_details():
    error = _as_error(errors.internal_status(KeyError("secret-path/token")))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in error.details()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"\x2a\x02\xff\xfe", "echo_metadata_keys"),  # field 5, two bytes that are not UTF-8
        (b"\x22\x03\x12\x01\xff", "response_status"),  # a nested message's bad string
        (b"\xff\xff\xff", "request"),  # not protobuf at all
    ],
)
async def test_bytes_that_do_not_parse_are_the_callers_invalid_argument(echo_server, data, field):
    """grpc answers a request its parser refuses as the server's failure; the mesh names
    the field that did not parse instead, for every service."""
    server = await echo_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        echo = channel.unary_unary("/aimesh.echo.v1.EchoService/Echo")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await echo(data, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in errors.field_violations(caught.value)] == [field]


def test_a_refusal_quoting_huge_input_still_fits_in_trailing_metadata():
    """grpc caps trailing metadata at 16 KiB: a status over it never reaches the caller."""
    huge = "é" * 300_000
    failure = InvalidInput([FieldViolation(huge, huge)] * 1000, message=huge)
    result = errors.status_for_failure(failure)
    size = sum(len(k) + len(v) for k, v in result.trailing_metadata) + len(result.details.encode())
    assert size < 8 * 1024
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT
