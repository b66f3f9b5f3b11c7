"""Both backends against sentence-transformers, and the tokenizing and batching they share."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from services.embedder.encoder import Encoder
from services.shared.minilm import pad
from tests.services.embedder.conftest import TEXTS, assert_same_vectors

pytestmark = pytest.mark.unit


def test_the_backends_agree_with_each_other(onnx_encoder: Encoder, torch_encoder: Encoder):
    for normalize in (False, True):
        onnx, onnx_tokens = onnx_encoder.encode(TEXTS, normalize=normalize)
        torch, torch_tokens = torch_encoder.encode(TEXTS, normalize=normalize)
        assert_same_vectors(onnx, torch)
        assert onnx_tokens == torch_tokens


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_a_backend_agrees_with_sentence_transformers(
    backend: str, request: pytest.FixtureRequest, sentence_transformer: SentenceTransformer
):
    encoder: Encoder = request.getfixturevalue(f"{backend}_encoder")
    vectors, tokens = encoder.encode(TEXTS)
    assert_same_vectors(vectors, sentence_transformer.encode(TEXTS, batch_size=32))
    expected = sentence_transformer.tokenizer(TEXTS, truncation=True, max_length=256)
    assert tokens == [len(ids) for ids in expected["input_ids"]]
    assert tokens[-1] == 256  # the long passage was cut to the model's maximum


def test_ids_match_sentence_transformers_tokenizer_on_both_sides(
    onnx_encoder: Encoder, sentence_transformer: SentenceTransformer
):
    hf = sentence_transformer.tokenizer
    long_text = TEXTS[-1]
    for side in ("right", "left"):
        (tokenized,) = onnx_encoder.tokenizer.tokenize([long_text], side)
        hf.truncation_side = side
        try:
            expected = hf(long_text, truncation=True, max_length=256)["input_ids"]
        finally:
            hf.truncation_side = "right"
        assert tokenized.ids == expected
        assert tokenized.length == len(hf(long_text)["input_ids"]) > 256
    (uncut,) = onnx_encoder.tokenizer.tokenize([long_text], None)
    assert len(uncut.ids) == uncut.length > 256


def test_padding_and_pass_boundaries_do_not_change_a_vector(onnx_encoder: Encoder):
    rows = [t.ids for t in onnx_encoder.tokenizer.tokenize(TEXTS, "right")]
    alone = np.concatenate([onnx_encoder.backend.pool(*pad([row])) for row in rows])
    together = onnx_encoder.embed(rows)  # one pass, everything padded to 256
    assert_same_vectors(together, alone, tolerance=1e-5)
    budget = Encoder(onnx_encoder.model, onnx_encoder.tokenizer, onnx_encoder.backend, 1)
    assert_same_vectors(budget.embed(rows), alone, tolerance=1e-5)  # one row per pass


def test_passes_group_rows_of_similar_length(onnx_encoder: Encoder):
    shapes: list[tuple[int, ...]] = []

    class Recording:
        def pool(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
            shapes.append(input_ids.shape)
            return onnx_encoder.backend.pool(input_ids, attention_mask)

    encoder = Encoder(onnx_encoder.model, onnx_encoder.tokenizer, Recording(), 64)
    short, long = [101, 7592, 102], [101, *range(1000, 1030), 102]
    encoder.embed([short, long, short, long, short])
    # Longest first; 64 padded tokens take two 32-token rows, then the three short ones.
    assert shapes == [(2, 32), (3, 3)]
