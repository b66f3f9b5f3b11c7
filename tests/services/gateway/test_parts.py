"""The gateway's pieces on their own: the error table, parameter paths, the key file,
and the SSE frames (the limits' arithmetic is mesh/metering.py's: tests/mesh)."""

from __future__ import annotations

import json

import grpc
import pytest

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, sampling_pb2
from mesh.errors import local_error, status
from mesh.failures import FieldViolation
from mesh.keys import digest
from services.gateway.errors import from_rpc, param_of, renamed
from services.gateway.keys import ANONYMOUS, KeyStore, OpenAccess
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


def test_no_key_file_means_everyone_is_the_anonymous_tenant():
    assert OpenAccess().lookup(None).tenant == ANONYMOUS


def test_frames_and_shapes():
    assert DONE == b"data: [DONE]\n\n"
    event = frame({"text": "é\n"})
    assert event == 'data: {"text":"é\\n"}\n\n'.encode()
    chat = ChatShape("m", 1, include_usage=True)
    text = TextShape("m", 1)
    assert chat.id.startswith("chatcmpl-") and text.id.startswith("cmpl-")
    chunk = generation_pb2.GenerationChunk(text="a")
    (chat_event,) = chat.chunk_events(chunk)
    assert json.loads(frame(chat_event)[6:])["usage"] is None
    assert "usage" not in text.chunk_events(chunk)[0]
    assert chat.chunk_events(chunk, 2)[0]["choices"][0]["index"] == 2
    assert chat.chunk_events(generation_pb2.GenerationChunk(token_ids=[1])) == []
    usage = chat.usage_event(common_pb2.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
    assert finish_reason(sampling_pb2.FINISH_REASON_LENGTH) == "length"
    for reason in (sampling_pb2.FINISH_REASON_EOS, sampling_pb2.FINISH_REASON_STOP_SEQUENCE):
        assert finish_reason(reason) == "stop"
