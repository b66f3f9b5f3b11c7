"""TokenizerService over real gRPC on 127.0.0.1, checked against transformers itself.

One server serves the whole module: starting one loads the tokenizer (~1 s).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from transformers import PreTrainedTokenizerBase

from aimesh.common.v1 import common_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.config import MeshSettings
from mesh.errors import field_violations
from mesh.failures import FieldViolation
from services.tokenizer.servicer import MAX_TEXT_BYTES, SERVICE
from tests.harness import InProcess

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "cjk": "日本語のテキストと中文文本 还有 한국어",
    "emoji": "party 🎉🙂 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇯🇵",
}
# Accents, CJK and emoji whose bytes byte-level BPE spreads over several tokens.
MULTI_BYTE = "naïve café 日本語 🙂👍🏽"
CONVERSATION = [
    ("system", "You answer in one line."),
    ("user", "What is 2 + 2?"),
    ("assistant", "4."),
    ("user", "And in Japanese? 🙂"),
]
VOCAB_SIZE = 49_152  # SmolLM2's, added tokens included
MAX_SEQ_LEN = 2048  # [engines.llm] default


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(
    mesh_settings: MeshSettings,
) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    async with InProcess() as services:
        served = await services.start("tokenizer", mesh_settings)
        channel = services.channel(served.target, SERVICE, settings=mesh_settings)
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)


def _chat_request(
    messages: list[tuple[str, str]], **options: bool
) -> tokenizer_pb2.ApplyChatTemplateRequest:
    return tokenizer_pb2.ApplyChatTemplateRequest(
        messages=[common_pb2.ChatMessage(role=role, content=content) for role, content in messages],
        **options,
    )


async def _violations(call: object) -> list[FieldViolation]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(caught.value)


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
async def test_tokenize_detokenize_round_trip(stub, hf_tokenizer, text):
    tokenized = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=5)
    assert list(tokenized.token_ids) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not tokenized.tokens and not tokenized.offsets
    detokenized = await stub.Detokenize(
        tokenizer_pb2.DetokenizeRequest(token_ids=tokenized.token_ids), timeout=5
    )
    assert detokenized.text == text


async def test_offsets_map_tokens_back_to_the_text(
    stub, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    response = await stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(text=MULTI_BYTE, return_details=True), timeout=5
    )
    ids = list(response.token_ids)
    assert list(response.tokens) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert len(response.offsets) == len(ids)
    covered: set[int] = set()
    for token_id, offset in zip(ids, response.offsets, strict=True):
        span = MULTI_BYTE[offset.start : offset.end]
        piece = hf_tokenizer.decode([token_id])
        if "\ufffd" in piece:  # part of a character: its span is the whole character
            assert piece.replace("\ufffd", "") in span
        else:
            assert span == piece
        covered.update(range(offset.start, offset.end))
    assert covered == set(range(len(MULTI_BYTE)))
    starts = [offset.start for offset in response.offsets]
    assert starts == sorted(starts)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
async def test_chat_template_matches_transformers(stub, hf_tokenizer, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in CONVERSATION],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    response = await stub.ApplyChatTemplate(
        _chat_request(
            CONVERSATION, add_generation_prompt=add_generation_prompt, return_token_ids=True
        ),
        timeout=5,
    )
    assert response.text == expected
    assert list(response.token_ids) == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    text_only = await stub.ApplyChatTemplate(
        _chat_request(CONVERSATION, add_generation_prompt=add_generation_prompt), timeout=5
    )
    assert text_only.text == expected
    assert not text_only.token_ids


async def test_stream_answers_every_id_without_splitting_a_character(stub):
    ids = list((await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=MULTI_BYTE))).token_ids)
    call = stub.DetokenizeStream(timeout=5)
    deltas = []
    for token_id in ids:
        await call.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=[token_id]))
        deltas.append((await call.read()).text)  # answered before the next id is sent
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF  # nothing was held back at the end
    whole = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=ids), timeout=5)
    assert "".join(deltas) == whole.text == MULTI_BYTE
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some ids only began a character


async def test_stream_cut_inside_a_character_ends_with_a_replacement(stub):
    ids = list((await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="ok 👍"))).token_ids)
    requests = [tokenizer_pb2.DetokenizeStreamRequest(token_ids=[id_]) for id_ in ids[:-1]]
    responses = [r.text async for r in stub.DetokenizeStream(iter(requests), timeout=5)]
    # One answer per message, then the held-back bytes as one last answer.
    assert len(responses) == len(requests) + 1
    assert responses[0] == "ok"
    assert responses[-1] == " \ufffd"
    assert "".join(responses) == "ok \ufffd"


async def test_stream_reads_skip_special_tokens_from_the_first_message(stub):
    hello = list((await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hello"))).token_ids)
    im_start = 1
    requests = [
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=[im_start], skip_special_tokens=True),
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=[im_start, *hello]),
    ]
    responses = [r.text async for r in stub.DetokenizeStream(iter(requests), timeout=5)]
    assert responses == ["", "hello"]


async def test_text_over_one_mib_of_utf8(stub):
    text = "é" * (MAX_TEXT_BYTES // 2 + 1)  # fewer characters than bytes: bytes count
    call = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=5)
    assert await _violations(call) == [
        FieldViolation("text", f"must be at most {MAX_TEXT_BYTES} bytes of UTF-8, got 1048578")
    ]


async def test_token_ids_outside_the_vocabulary(stub):
    request = tokenizer_pb2.DetokenizeRequest(token_ids=[1, VOCAB_SIZE, 5, 2**32 - 1])
    assert await _violations(stub.Detokenize(request, timeout=5)) == [
        FieldViolation("token_ids[1]", f"must be < the vocabulary size {VOCAB_SIZE}, got 49152"),
        FieldViolation(
            "token_ids[3]", f"must be < the vocabulary size {VOCAB_SIZE}, got 4294967295"
        ),
    ]


async def test_more_ids_than_the_context(stub):
    request = tokenizer_pb2.DetokenizeRequest(token_ids=[0] * (MAX_SEQ_LEN + 1))
    assert await _violations(stub.Detokenize(request, timeout=5)) == [
        FieldViolation("token_ids", f"must hold at most {MAX_SEQ_LEN} ids, got {MAX_SEQ_LEN + 1}")
    ]


async def test_stream_refuses_an_id_outside_the_vocabulary(stub):
    call = stub.DetokenizeStream(timeout=5)
    await call.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=[28120]))
    assert (await call.read()).text == "hello"
    await call.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=[2, VOCAB_SIZE + 7]))
    assert await _violations(call.read()) == [
        FieldViolation("token_ids[1]", f"must be < the vocabulary size {VOCAB_SIZE}, got 49159")
    ]


async def test_empty_conversation(stub):
    assert await _violations(stub.ApplyChatTemplate(_chat_request([]), timeout=5)) == [
        FieldViolation("messages", "must hold at least one message")
    ]


async def test_every_bad_message_is_reported(stub):
    messages = [("user", "hi"), ("wizard", "abracadabra"), ("user", "x" * (MAX_TEXT_BYTES + 1))]
    assert await _violations(stub.ApplyChatTemplate(_chat_request(messages), timeout=5)) == [
        FieldViolation(
            "messages[1].role", "must be one of assistant, system, tool, user, got 'wizard'"
        ),
        FieldViolation(
            "messages[2].content",
            f"must be at most {MAX_TEXT_BYTES} bytes of UTF-8, got {MAX_TEXT_BYTES + 1}",
        ),
    ]
