"""Input that cannot become a 500: lone surrogates, integers past what the protos carry,
NaN and infinities are 400s naming the parameter; bodies past the gateway's own cap are
413 (at once on Content-Length, as they grow when chunked), bodies that trickle are 408,
each closing the connection; every error the gateway can answer is in OpenAI's shape; and
a short run of the HTTP fuzzer (loadtest/fuzz_gateway.py) finds nothing. One gateway per
module, with a small cap and deadline so that the limits are cheap to reach."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from loadtest.fuzz_gateway import fuzz
from loadtest.fuzz_http import Models
from services.gateway.catalog import Catalog
from tests.conftest import eventually
from tests.services.gateway.conftest import KEY, Gateway, running_gateway
from tests.services.gateway.fakes import EMBEDDING_MODEL, IMAGE_MODEL, LLM

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

MAX_BODY_BYTES = 64 * 1024
BODY_READ_TIMEOUT_S = 1.0
# How long a test waits for an answer that must come (at once, or after the deadline).
ANSWER_WAIT_S = 30.0
CHAT = "/v1/chat/completions"


def chat(content: object = "hi there", **extra: object) -> dict:
    return {"model": LLM, "messages": [{"role": "user", "content": content}], **extra}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory) -> AsyncIterator[Gateway]:
    async with running_gateway(
        tmp_path_factory.mktemp("hostile"),
        max_body_bytes=MAX_BODY_BYTES,
        body_read_timeout_s=BODY_READ_TIMEOUT_S,
    ) as started:
        yield started


def mesh_calls(gateway: Gateway) -> tuple[int, int, int]:
    return (
        len(gateway.generation.requests),
        gateway.embedder.calls,
        len(gateway.diffusion.requests),
    )


def answered(route: str, status: int) -> float:
    value = REGISTRY.get_sample_value(
        "aimesh_gateway_requests_total", {"route": route, "status": str(status)}
    )
    return value or 0.0


def assert_openai_error(body: dict, param: str | None = None) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, body
    return error


async def post_json(gateway: Gateway, path: str, body: object) -> tuple[int, dict]:
    """`body` as ASCII JSON: a lone surrogate goes as its `\\ud800` escape, NaN and
    infinities as Python's json writes them."""
    async with gateway.http() as client:
        answer = await client.post(
            path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
    return answer.status_code, answer.json()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat("a\ud800b"), "messages[0].content"),
        (CHAT, chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]),
         "messages[0].content[1].text"),
        (CHAT, {**chat(), "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
         "messages[0].name"),
        (CHAT, chat(stop="end\ud800"), "stop"),
        (CHAT, chat(stop=["ok", "x\udc00"]), "stop[1]"),
        (CHAT, {**chat(), "model": "fake\ud800"}, "model"),
        (CHAT, chat(user="\ud800"), "user"),
        (CHAT, chat(cache_salt="salt\ud800"), "cache_salt"),
        (CHAT, chat(metadata={"note": "\ud800"}), "metadata.note"),
        (CHAT, chat(logit_bias={"\ud800": 1}), "logit_bias.\\ud800"),
        ("/v1/completions", {"model": LLM, "prompt": "a\ud800"}, "prompt"),
        ("/v1/completions", {"model": LLM, "prompt": ["\ud800"]}, "prompt[0]"),
        ("/v1/completions", {"model": LLM, "prompt": "a", "suffix": "\ud800"}, "suffix"),
        ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "a\ud800"}, "input"),
        ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": ["ok", "\ud800"]}, "input[1]"),
        ("/v1/rerank", {"model": "r", "query": "\ud800", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"model": "r", "query": "q", "documents": ["\ud800"]}, "documents[0]"),
        ("/v1/rerank", {"model": "r", "query": "q", "documents": ["a", {"text": "\ud800"}]},
         "documents[1].text"),
        ("/v1/images/generations", {"model": IMAGE_MODEL, "prompt": "\ud800"}, "prompt"),
        ("/v1/images/generations",
         {"model": IMAGE_MODEL, "prompt": "1", "conditioning": {"\ud800": 1}},
         "conditioning.\\ud800"),
    ],
)  # fmt: skip
async def test_a_lone_surrogate_is_a_400_naming_where_it_is(gateway, path, body, param):
    before = mesh_calls(gateway)
    status, answer = await post_json(gateway, path, body)
    assert status == 400, answer
    error = assert_openai_error(answer, param)
    assert error["type"] == "invalid_request_error"
    assert "lone UTF-16 surrogate" in error["message"]
    assert mesh_calls(gateway) == before  # refused before the mesh was called


async def test_surrogates_sent_as_their_own_utf8_bytes_are_refused_too(gateway):
    """Python's json reads UTF-8-encoded surrogates back as lone surrogates."""
    raw = json.dumps(chat("PLACEHOLDER")).encode().replace(b"PLACEHOLDER", b"a\xed\xa0\x80")
    async with gateway.http() as client:
        answer = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert_openai_error(answer.json(), "messages[0].content")


async def test_paired_surrogates_are_one_character_and_served(gateway):
    raw = json.dumps(chat("smile \ud83d\ude00")).encode()
    async with gateway.http() as client:
        answer = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert gateway.generation.requests[-1].messages[-1].content == "smile \U0001f600"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat(max_tokens=2**31), "max_tokens"),
        (CHAT, chat(max_completion_tokens=2**31), "max_completion_tokens"),
        (CHAT, chat(max_tokens=10**30), "max_tokens"),
        (CHAT, chat(n=2**31), "n"),
        (CHAT, chat(top_logprobs=2**31), "top_logprobs"),
        (CHAT, chat(seed=2**64), "seed"),
        (CHAT, chat(logit_bias={"1": float("nan")}), "logit_bias"),
        (CHAT, chat(temperature=float("inf")), "temperature"),
        ("/v1/completions", {"model": LLM, "prompt": "a", "max_tokens": 2**31}, "max_tokens"),
        ("/v1/completions", {"model": LLM, "prompt": "a", "best_of": 2**31}, "best_of"),
        ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "a", "dimensions": 2**31},
         "dimensions"),
        ("/v1/rerank", {"model": "r", "query": "q", "documents": ["a"], "top_n": 2**31},
         "top_n"),
        ("/v1/images/generations", {"model": IMAGE_MODEL, "prompt": "1", "steps": 2**31},
         "steps"),
        ("/v1/images/generations", {"model": IMAGE_MODEL, "prompt": "1", "seed": 2**64},
         "seed"),
        ("/v1/images/generations",
         {"model": IMAGE_MODEL, "prompt": "1", "conditioning": {"difficulty": float("nan")}},
         "conditioning.difficulty"),
        ("/v1/images/generations",
         {"model": IMAGE_MODEL, "prompt": "1", "conditioning": {"difficulty": float("inf")}},
         "conditioning.difficulty"),
    ],
)  # fmt: skip
async def test_numbers_past_the_proto_field_are_a_400_naming_it(gateway, path, body, param):
    before = mesh_calls(gateway)
    status, answer = await post_json(gateway, path, body)
    assert status == 400, answer
    assert_openai_error(answer, param)
    assert mesh_calls(gateway) == before


async def test_an_embeddings_request_holds_at_most_openais_2048_inputs(gateway):
    before = mesh_calls(gateway)
    body = {"model": EMBEDDING_MODEL, "input": ["a"] * 2049}
    status, answer = await post_json(gateway, "/v1/embeddings", body)
    assert status == 400, answer
    assert_openai_error(answer, "input")
    assert mesh_calls(gateway) == before
    status, answer = await post_json(gateway, "/v1/embeddings", {**body, "input": ["a"] * 2048})
    assert status == 200, answer
    assert len(answer["data"]) == 2048


async def test_the_largest_int32_is_still_served(gateway):
    status, answer = await post_json(gateway, CHAT, chat(max_tokens=2**31 - 1))
    assert status == 200, answer
    assert gateway.generation.requests[-1].stopping.max_new_tokens == 2**31 - 1
    status, answer = await post_json(
        gateway, "/v1/images/generations", {"model": IMAGE_MODEL, "prompt": "1", "steps": 2**31 - 1}
    )
    assert status == 200, answer


async def test_cache_salt_is_validated(gateway):
    for path, body in [(CHAT, chat()), ("/v1/completions", {"model": LLM, "prompt": "a"})]:
        status, answer = await post_json(gateway, path, {**body, "cache_salt": "tenant-7:v2 ü"})
        assert status == 200, answer
        for salt in ["", "x" * 257, "a\nb", "\x00", 7]:
            status, answer = await post_json(gateway, path, {**body, "cache_salt": salt})
            assert status == 400, (salt, answer)
            assert_openai_error(answer, "cache_salt")


async def exchange(gateway: Gateway, head: bytes, *chunks: bytes) -> tuple[int, dict, dict]:
    """Sends a request's head and `chunks` on a connection of its own, then reads until
    the server closes it (a server that keeps it open fails the test): the status, the
    headers and the JSON body."""
    port = int(gateway.url.rpartition(":")[2])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        for chunk in chunks:
            writer.write(chunk)
        await writer.drain()
        async with asyncio.timeout(ANSWER_WAIT_S):
            data = await reader.read()  # to the end: the server must close the connection
    finally:
        writer.close()
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(body)


def request_head(path: str, *extra: str) -> bytes:
    """An HTTP/1.1 POST's head, to its blank line."""
    lines = [
        f"POST {path} HTTP/1.1",
        "host: 127.0.0.1",
        f"authorization: Bearer {KEY}",
        "content-type: application/json",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_a_content_length_past_the_cap_is_413_before_the_body_is_read(gateway):
    before = answered(CHAT, 413)
    head = request_head(CHAT, f"content-length: {64 * 1024 * 1024}")
    status, headers, body = await exchange(gateway, head)  # not a byte of the body sent
    assert status == 413
    assert headers["connection"] == "close"
    assert assert_openai_error(body)["code"] == "request_too_large"
    assert answered(CHAT, 413) == before + 1


async def test_a_chunked_body_growing_past_the_cap_is_413(gateway):
    before = answered("/v1/embeddings", 413)
    piece = b"a" * (16 * 1024)
    chunks = [b'10\r\n{"input": "aaaaa\r\n'] + [b"4000\r\n" + piece + b"\r\n"] * 5
    head = request_head("/v1/embeddings", "transfer-encoding: chunked")
    status, headers, body = await exchange(gateway, head, *chunks)
    assert status == 413
    assert headers["connection"] == "close"
    assert assert_openai_error(body)["code"] == "request_too_large"
    assert answered("/v1/embeddings", 413) == before + 1


async def test_a_body_that_trickles_past_the_deadline_is_408(gateway):
    before = answered(CHAT, 408)
    head = request_head(CHAT, "content-length: 1000")
    status, headers, body = await exchange(gateway, head, b'{"model": ')
    assert status == 408
    assert headers["connection"] == "close"
    assert assert_openai_error(body)["code"] == "request_timeout"
    assert answered(CHAT, 408) == before + 1


async def test_a_client_that_leaves_mid_body_is_counted_as_gone(gateway):
    before = answered(CHAT, 499), answered(CHAT, 500)
    port = int(gateway.url.rpartition(":")[2])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_head(CHAT, "content-length: 1000") + b'{"model"')
    await writer.drain()
    writer.close()
    await eventually(lambda: answered(CHAT, 499) == before[0] + 1)
    assert answered(CHAT, 500) == before[1]


async def test_a_client_still_writing_its_oversize_body_reads_the_413(gateway):
    """httpx and the openai SDK write the whole body before they read: the connection
    lingers long enough for them to see the 413, not a reset (which the SDK would retry,
    sending it all again)."""
    oversize = json.dumps(chat("x" * (8 * 1024 * 1024))).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(oversize), 64 * 1024):
            yield oversize[start : start + 64 * 1024]

    async with gateway.http() as client:
        for content in (oversize, pieces()):
            answer = await client.post(
                CHAT, content=content, headers={"content-type": "application/json"}
            )
            assert answer.status_code == 413
            assert assert_openai_error(answer.json())["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as refused:
        await gateway.sdk(max_retries=2).chat.completions.create(
            model=LLM, messages=[{"role": "user", "content": "x" * (8 * 1024 * 1024)}]
        )
    assert refused.value.status_code == 413
    # The answer to its first try: not sent again.
    assert refused.value.response.request.headers["x-stainless-retry-count"] == "0"


async def test_a_body_just_under_the_cap_is_served(gateway):
    body = json.dumps(chat("x")).encode()
    padded = json.dumps(chat("x" * (MAX_BODY_BYTES - len(body) + 1))).encode()
    assert len(padded) == MAX_BODY_BYTES
    async with gateway.http() as client:
        answer = await client.post(
            CHAT, content=padded, headers={"content-type": "application/json"}
        )
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("method", "path", "headers", "content", "status"),
    [
        ("GET", "/v1/nothing-here", {}, None, 404),
        ("GET", "/", {}, None, 404),
        ("PUT", CHAT, {}, None, 405),
        ("DELETE", "/v1/models", {}, None, 405),
        ("POST", CHAT, {"content-type": "application/json"}, b"{nope", 400),
        ("POST", CHAT, {"content-type": "application/json"}, b"", 400),
        ("POST", CHAT, {"content-type": "application/json"}, b"[1, 2]", 400),
        ("POST", CHAT, {"content-type": "application/json"}, b"[" * 60_000, 400),
        ("POST", CHAT, {"content-type": "application/json"}, b"\xff\xfe\x00garbage", 400),
        ("POST", CHAT, {"content-type": "application/json"},
         b'{"max_tokens": 1' + b"0" * 5000 + b"}", 400),
        ("POST", CHAT, {"content-type": "text/plain"}, json.dumps(chat()).encode(), 415),
        ("POST", CHAT, {}, json.dumps(chat()).encode(), 415),
        ("POST", "/v1/embeddings", {"content-type": "application/x-www-form-urlencoded"},
         b"model=x&input=y", 415),
    ],
)  # fmt: skip
async def test_every_error_is_in_openais_shape(gateway, method, path, headers, content, status):
    async with gateway.http() as client:
        answer = await client.request(method, path, headers=headers, content=content)
    assert answer.status_code == status, answer.text
    error = assert_openai_error(answer.json())
    if status == 405:
        assert "allow" in answer.headers
    if status == 415:
        assert error["code"] == "unsupported_media_type"


async def test_a_bug_is_a_500_in_openais_shape_naming_the_request_id(gateway, monkeypatch):
    def broken(self: Catalog) -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Catalog, "as_openai", broken)
    before = answered("/v1/models", 500)
    async with gateway.http() as client:
        answer = await client.get("/v1/models", headers={"x-request-id": "bug-1"})
    assert answer.status_code == 500
    error = assert_openai_error(answer.json())
    assert error["type"] == "server_error"
    assert "bug-1" in error["message"] and "a bug" not in error["message"]
    assert answered("/v1/models", 500) == before + 1


async def test_a_short_fuzz_run_finds_nothing(gateway):
    """The HTTP fuzzer's short run (`make fuzz` runs the long one against a whole mesh):
    generated, garbage, oversize and hostile requests on every route."""
    models = Models(chat=LLM, embedding=EMBEDDING_MODEL, image=IMAGE_MODEL, rerank="none")
    report = await fuzz(
        gateway.url, models, requests=300, seconds=60, seed=43, key=KEY,
        max_body_bytes=MAX_BODY_BYTES,
    )  # fmt: skip
    assert report.made >= 100, report.statuses
    assert not report.findings, "\n".join(finding.describe() for finding in report.findings)
    assert not report.health_after, report.health_after
