"""Property: whatever a caller sends, the tokenizer answers OK or INVALID_ARGUMENT naming a
field (or CANCELLED when the caller cancels), never INTERNAL or UNKNOWN or a hang, and it
answers a normal request right after.

Requests go over real gRPC to one tokenizer server in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aimesh.common.v1 import common_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.config import MeshSettings
from mesh.errors import field_violations
from services.tokenizer.servicer import SERVICE
from tests.harness import InProcess
from tests.strategies import mostly
from tests.strategies import wild_strings as wild_strings_of

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
PROPERTY = settings(
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Strings: short random text, words that mean something here (roles, template syntax,
# chat markers), and runs of one character up to 300 KB.
WORDS = (
    "", " ", "user", "assistant", "{{ 7 * 7 }}", "{% for x in y %}", "{#", "<|im_start|>",
    "<|im_end|>", "\x00", "\x1b[31m", "\ufffd", "é", "\u200b\u202e",
)  # fmt: skip
wild_strings = wild_strings_of(WORDS, [65, 9000, 300_000])


request_ids = mostly(st.sampled_from(["", "req-1"]), wild_strings)
# In and out of the vocabulary (49,152), held-back bytes (111), special tokens (0-16).
known_ids = st.integers(0, 49_151)
wild_ids = st.one_of(
    known_ids,
    st.sampled_from([0, 1, 2, 111, 49_151, 49_152, 2**31, 2**32 - 1]),
    st.integers(0, 2**32 - 1),
)
id_lists = mostly(
    st.lists(known_ids, max_size=40),
    st.one_of(
        st.lists(wild_ids, max_size=40),
        st.sampled_from([2048, 2049, 100_000]).map(lambda n: [111] * n),
    ),
)
roles = mostly(st.sampled_from(["user", "assistant", "system", "tool"]), wild_strings)
messages = st.one_of(
    st.lists(st.builds(common_pb2.ChatMessage, role=roles, content=wild_strings), max_size=6),
    st.sampled_from([2048, 2049, 20_000]).map(
        lambda n: [common_pb2.ChatMessage(role="user", content="hi")] * n
    ),
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(
    mesh_settings: MeshSettings,
) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    async with InProcess() as services:
        served = await services.start("tokenizer", mesh_settings)
        channel = services.channel(served.target, SERVICE, settings=mesh_settings)
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


async def _status(call: object) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return _refusal(error)
    event("OK")
    return grpc.StatusCode.OK


def _refusal(error: grpc.aio.AioRpcError) -> grpc.StatusCode:
    event(error.code().name)
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        assert field_violations(error), "a refusal must name the field"
    return error.code()


async def _still_serves(stub: tokenizer_pb2_grpc.TokenizerServiceStub) -> None:
    response = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hello world"), timeout=10)
    assert list(response.token_ids) == [28120, 905]


@PROPERTY
@given(
    request=st.builds(
        tokenizer_pb2.TokenizeRequest,
        request_id=request_ids,
        text=wild_strings,
        add_special_tokens=st.booleans(),
        return_details=st.booleans(),
    )
)
async def test_tokenize(stub, request):
    assert await _status(stub.Tokenize(request, timeout=60)) in ANSWERS
    await _still_serves(stub)


@PROPERTY
@given(
    request=st.builds(
        tokenizer_pb2.DetokenizeRequest,
        request_id=request_ids,
        token_ids=id_lists,
        skip_special_tokens=st.booleans(),
    )
)
async def test_detokenize(stub, request):
    assert await _status(stub.Detokenize(request, timeout=60)) in ANSWERS
    await _still_serves(stub)


@PROPERTY
@given(
    request=st.builds(
        tokenizer_pb2.ApplyChatTemplateRequest,
        request_id=request_ids,
        messages=messages,
        add_generation_prompt=st.booleans(),
        return_token_ids=st.booleans(),
    )
)
async def test_apply_chat_template(stub, request):
    assert await _status(stub.ApplyChatTemplate(request, timeout=60)) in ANSWERS
    await _still_serves(stub)


@PROPERTY
@given(
    stream=st.lists(
        st.builds(
            tokenizer_pb2.DetokenizeStreamRequest,
            request_id=request_ids,
            token_ids=id_lists,
            skip_special_tokens=st.booleans(),
        ),
        max_size=5,
    ),
    cancel_at=st.one_of(st.none(), st.integers(0, 5)),
)
async def test_detokenize_stream(stub, stream, cancel_at):
    """Each message answered before the next is sent; the caller may cancel before any."""
    call = stub.DetokenizeStream(timeout=60)
    try:
        for index, message in enumerate(stream):
            if index == cancel_at:
                call.cancel()
                break
            await call.write(message)
            await call.read()
        else:
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
    except grpc.aio.AioRpcError as error:
        assert _refusal(error) in ANSWERS
    except asyncio.InvalidStateError:  # a write after the server ended the call
        pass
    code = await call.code()
    assert code in ANSWERS | {grpc.StatusCode.CANCELLED}
    assert code != grpc.StatusCode.CANCELLED or cancel_at is not None
    await _still_serves(stub)
