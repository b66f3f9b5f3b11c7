"""The router's token pieces for logprobs (services/generation/logprobs.py): each token's
exact bytes, so that tokens holding parts of a character still add up to the text."""

from __future__ import annotations

import pytest

from aimesh.llm.v1 import decode_pb2, sampling_pb2
from services.generation.logprobs import TokenPieces, pieces_of
from services.llm.artifacts import load_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def test_the_tokens_bytes_make_the_text_even_inside_a_character(tokenizer):
    text = "héllo wörld 你好 🙂\n  x"
    ids = tokenizer.encode(text).ids
    pieces = TokenPieces(tokenizer)
    raw = [pieces.piece(i)[0] for i in ids]
    assert b"".join(raw).decode() == text
    split = [i for i, piece in enumerate(raw) if piece and not _is_utf8(piece)]
    assert split, "the sample must split a character across tokens"
    assert all("\ufffd" in pieces.piece(ids[i])[1] for i in split)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_special_and_padded_tokens(tokenizer):
    pieces = TokenPieces(tokenizer)
    assert pieces.piece(2) == (b"<|im_end|>", "<|im_end|>")
    assert pieces.piece(tokenizer.get_vocab_size() + 5) == (b"", "")


def test_entries_pair_each_token_with_its_alternatives(tokenizer):
    ids = tokenizer.encode(" the cat").ids
    chunk = decode_pb2.TokenChunk(
        token_ids=ids,
        logprobs=[-0.5] * len(ids),
        top_logprobs=[
            sampling_pb2.TopLogprobs(token_ids=[i, 28], logprobs=[-0.5, -2.0]) for i in ids
        ],
    )
    entries = TokenPieces(tokenizer).entries(chunk)
    assert "".join(e.token for e in entries) == " the cat"
    assert [[t.token for t in e.top_logprobs] for e in entries] == [[e.token, ","] for e in entries]
    bare = TokenPieces(tokenizer).entries(
        decode_pb2.TokenChunk(token_ids=ids, logprobs=[-0.5] * len(ids))
    )
    assert all(not e.top_logprobs for e in bare)


def test_pools_of_one_tokenizer_share_its_pieces(tokenizer, model_dir):
    assert pieces_of(tokenizer) is pieces_of(tokenizer)
    assert pieces_of(load_tokenizer(model_dir)) is not pieces_of(tokenizer)
