"""The gateway's pieces on their own: the error table, parameter paths, the key file,
the limits' arithmetic (the in-process store, on a stopped clock), and the SSE frames."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import grpc
import pytest

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import sampling_pb2
from mesh.errors import local_error, status
from mesh.failures import FieldViolation
from mesh.keys import digest
from services.gateway import store as stores
from services.gateway.errors import ApiError, from_rpc, param_of, renamed
from services.gateway.keys import ANONYMOUS, KeyStore, OpenAccess, Principal, TenantLimits
from services.gateway.limits import Limiter
from services.gateway.periods import current
from services.gateway.sse import DONE, ChatShape, TextShape, finish_reason, frame
from tests.services.gateway.conftest import write_keys

pytestmark = pytest.mark.unit

PARAMS = {"sampling.temperature": "temperature", "messages": "messages", "inputs[3]": "input[35]"}


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("sampling.temperature", "temperature"),
        ("messages[2].role", "messages[2].role"),
        ("messages", "messages"),
        ("messagesx", "messagesx"),
        ("inputs[3]", "input[35]"),
        ("inputs[30]", "inputs[30]"),
    ],
)
def test_mesh_fields_are_renamed_by_their_longest_known_prefix(field, param):
    assert renamed(field, PARAMS) == param


@pytest.mark.parametrize(
    ("location", "param"),
    [
        (("body", "messages", 0, "role"), "messages[0].role"),
        (("body", "stop", "list[str]", 5), "stop"),
        (("body", "messages", 1, "content", "list[TextPart]", 0, "type"), "messages[1].content"),
        (("body", "temperature"), "temperature"),
        (("body",), None),
    ],
)
def test_validation_locations_become_parameter_paths(location, param):
    assert param_of(location) == param


def test_a_rich_status_becomes_one_openai_error():
    violation = FieldViolation("sampling.temperature", "must be in [0, 2]")
    error = from_rpc(
        local_error(
            status(
                grpc.StatusCode.INVALID_ARGUMENT,
                "x",
                reason="INVALID_INPUT",
                violations=[violation],
            )
        ),
        PARAMS,
    )
    assert (error.status, error.param, error.code) == (400, "temperature", "invalid_input")
    assert error.body()["error"]["message"] == "temperature: must be in [0, 2]"
    busy = from_rpc(
        local_error(
            status(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", reason="QUEUE_FULL", retry_after_s=0.2
            )
        ),
        PARAMS,
    )
    assert busy.status == 429
    assert busy.headers == {"retry-after-ms": "200", "retry-after": "1"}


@pytest.mark.parametrize(
    ("code", "http"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.UNKNOWN, 500),
        (grpc.StatusCode.DATA_LOSS, 500),
    ],
)
def test_codes_map_to_http_statuses(code, http):
    error = from_rpc(local_error(status(code, "internal detail", reason="WHY")), {})
    assert error.status == http
    assert ("internal detail" in error.message) == (http != 500)


def test_the_key_file_is_reread_when_it_changes_and_a_broken_one_keeps_the_last_keys(tmp_path):
    path = tmp_path / "keys.json"
    write_keys(path, {"k1": ("t1", ["generate"])})
    store = KeyStore(path)
    assert store.lookup("k1").tenant == "t1"
    assert store.lookup(None) is None and store.lookup("k2") is None
    write_keys(path, {"k2": ("t2", ["embed", "admin"])})
    assert store.lookup("k1") is None
    assert store.lookup("k2").scopes == frozenset({"embed", "admin"})
    path.write_text('{"keys": [{"sha256": "not hex", "tenant": "x", "scopes": []}]}')
    assert store.lookup("k2").tenant == "t2"
    path.unlink()
    assert store.lookup("k2") is None


def test_a_toml_key_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(f'[[keys]]\nsha256 = "{digest("k")}"\ntenant = "t"\nscopes = ["images"]\n')
    assert KeyStore(path).lookup("k").scopes == frozenset({"images"})


def test_tenants_limits_come_from_the_key_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[keys]]\nsha256 = "{digest("k")}"\ntenant = "t"\nscopes = ["generate"]\n'
        f'[[keys]]\nsha256 = "{digest("j")}"\ntenant = "free"\nscopes = ["generate"]\n'
        "[tenants.t]\nrequests_per_minute = 5\ntoken_budget = 100\n"
    )
    keys = KeyStore(path)
    assert keys.lookup("k").limits == TenantLimits(requests_per_minute=5, token_budget=100)
    assert keys.lookup("j").limits == TenantLimits()
    path.write_text(path.read_text() + "[tenants.t]\nbogus = 1\n")  # refused: last file stays
    assert keys.lookup("k").limits.requests_per_minute == 5


async def test_the_limiters_refusals_and_settlement(buckets_clock):
    limiter = Limiter(stores.MemoryStore(), window_s=60, reserve_tokens=8)
    who = Principal("t", frozenset(), TenantLimits(requests_per_minute=1, tokens_per_minute=10))
    held = await limiter.admit(who, 9)
    await held.settle(3)  # 7 tokens left
    with pytest.raises(ApiError) as refused:
        await limiter.admit(who, 1)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.headers == {"retry-after-ms": "60000", "retry-after": "60"}
    buckets_clock[0] += 60
    with pytest.raises(ApiError) as too_big:
        await limiter.admit(who, 11)
    assert too_big.value.code == "request_too_large" and not too_big.value.headers
    assert (await limiter.admit(who, 10)).tokens == 10


@pytest.mark.parametrize(
    ("period", "now", "label", "ends"),
    [
        ("day", datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC), "2026-12-31", datetime(2027, 1, 1)),
        ("month", datetime(2026, 12, 31, 12, tzinfo=UTC), "2026-12", datetime(2027, 1, 1)),
        ("month", datetime(2026, 2, 1, tzinfo=UTC), "2026-02", datetime(2026, 3, 1)),
        ("lifetime", datetime(2026, 2, 1, tzinfo=UTC), "", None),
    ],
)  # fmt: skip
def test_budget_periods_are_utc_calendar_days_and_months(period, now, label, ends):
    span = current(period, now)
    assert span.label == label
    assert span.ends == (ends and ends.replace(tzinfo=UTC))


async def test_a_periodic_budget_renews_and_a_late_settlement_lands_where_it_was_charged(
    buckets_clock,
):
    today = [datetime(2026, 12, 3, 23, 0, tzinfo=UTC)]
    store = stores.MemoryStore()
    limiter = Limiter(store, clock=lambda: today[0])
    who = Principal("t", frozenset(), TenantLimits(token_budget=10, budget_period="day"))
    running = await limiter.admit(who, 8)  # a stream that will end tomorrow
    with pytest.raises(ApiError) as spent:
        await limiter.admit(who, 3)
    assert spent.value.code == "insufficient_quota"
    assert "renews at 2026-12-04T00:00:00+00:00" in spent.value.message
    today[0] += timedelta(hours=2)
    await running.settle(2)  # gives 6 back to the 3rd, not to the 4th
    assert (await limiter.admit(who, 10)).tokens == 10  # the 4th's whole budget
    with pytest.raises(ApiError):
        await limiter.admit(who, 1)
    # The 3rd's counter outlives its day by the grace period, then goes.
    assert store._spent[f"{stores.PREFIX}token_budget:t:2026-12-03"] == 2
    buckets_clock[0] += timedelta(days=1, hours=2).total_seconds()
    await store.take([])
    assert list(store._spent) == [f"{stores.PREFIX}token_budget:t:2026-12-04"]


def test_no_key_file_means_everyone_is_the_anonymous_tenant():
    assert OpenAccess().lookup(None).tenant == ANONYMOUS


def test_frames_and_shapes():
    assert DONE == b"data: [DONE]\n\n"
    event = frame({"text": "é\n"})
    assert event == 'data: {"text":"é\\n"}\n\n'.encode()
    chat = ChatShape("m", 1, include_usage=True)
    text = TextShape("m", 1)
    assert chat.id.startswith("chatcmpl-") and text.id.startswith("cmpl-")
    assert json.loads(frame(chat.text_event("a"))[6:])["usage"] is None
    assert "usage" not in text.text_event("a")
    usage = chat.usage_event(common_pb2.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    assert finish_reason(sampling_pb2.FINISH_REASON_LENGTH) == "length"
    for reason in (sampling_pb2.FINISH_REASON_EOS, sampling_pb2.FINISH_REASON_STOP_SEQUENCE):
        assert finish_reason(reason) == "stop"
