"""Texts to vectors in this thread: tokenizer, backend and the way rows share passes.

The engine runs `embed` for every micro-batch; benchmarks and tests call `encode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.embedder.backends import Backend, load_backend
from services.embedder.model import SentenceModel, default_model
from services.embedder.settings import EmbedderSettings
from services.embedder.tokens import TextTokenizer, pad


@dataclass
class Encoder:
    model: SentenceModel
    tokenizer: TextTokenizer
    backend: Backend
    max_batch_tokens: int

    @classmethod
    def load(cls, settings: EmbedderSettings, cache_dir: Path) -> Encoder:
        """The embedded model on the configured backend (exporting its ONNX graph once)."""
        model = default_model()
        backend = load_backend(settings.backend, model, cache_dir, settings.threads)
        tokenizer = TextTokenizer(model.path, model.max_tokens)
        return cls(model, tokenizer, backend, settings.max_batch_tokens)

    def embed(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Unnormalised vectors of tokenized rows, in their order.

        Rows run longest first, in forward passes of at most max_batch_tokens padded
        tokens (always at least one row): neighbours in length share a pass, so a short
        text is not padded to a long one's length unless they fit one pass anyway.
        """
        order = sorted(range(len(rows)), key=lambda index: len(rows[index]), reverse=True)
        vectors = np.empty((len(rows), self.model.dimensions), dtype=np.float32)
        start = 0
        while start < len(order):
            width = len(rows[order[start]])
            chunk = order[start : start + max(1, self.max_batch_tokens // width)]
            vectors[chunk] = self.backend.pool(*pad([rows[index] for index in chunk]))
            start += len(chunk)
        return vectors

    def encode(
        self, texts: Sequence[str], *, normalize: bool = True
    ) -> tuple[np.ndarray, list[int]]:
        """Vectors of `texts` and the tokens each one used, cut at the model's maximum on
        the right, as sentence-transformers cuts them."""
        tokenized = self.tokenizer.tokenize(texts, "right")
        vectors = self.embed([each.ids for each in tokenized])
        return (normalized(vectors) if normalize else vectors), [len(t.ids) for t in tokenized]


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (a zero row stays zero), as torch's F.normalize does."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
