"""Texts to vectors: tokenizer, backend and the way rows share passes.

The engine runs `embed` (in its model thread) or `embed_remote` (on Triton) for every
micro-batch; benchmarks and tests call `encode`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mesh.config import MeshSettings
from services.embedder.backends import Backend, OnnxBackend, TorchBackend, TritonBackend, onnx_graph
from services.embedder.model import SentenceModel, default_model
from services.embedder.settings import EmbedderSettings
from services.shared.minilm import TextTokenizer, normalized, pad


@dataclass
class Encoder:
    model: SentenceModel
    tokenizer: TextTokenizer
    backend: Backend | TritonBackend
    max_batch_tokens: int

    @classmethod
    def load(
        cls, settings: EmbedderSettings, cache_dir: Path, mesh: MeshSettings | None = None
    ) -> Encoder:
        """The embedded model on the configured backend (exporting its ONNX graph once)."""
        model = default_model()
        if settings.backend == "triton":
            assert settings.triton is not None  # the settings' validator requires it
            backend: Backend | TritonBackend = TritonBackend(
                settings.triton, mesh or MeshSettings()
            )
        elif settings.backend == "torch":
            backend = TorchBackend(model, settings.threads)
        else:
            backend = OnnxBackend(onnx_graph(model, cache_dir), settings.threads)
        tokenizer = TextTokenizer(model.path, model.max_tokens)
        return cls(model, tokenizer, backend, settings.max_batch_tokens)

    @property
    def remote(self) -> bool:
        return isinstance(self.backend, TritonBackend)

    def passes(self, rows: Sequence[Sequence[int]]) -> list[list[int]]:
        """Row indices per forward pass: longest first, at most max_batch_tokens padded
        tokens a pass (always at least one row), so neighbours in length share a pass and
        a short text is not padded to a long one's length unless they fit one pass anyway.
        """
        order = sorted(range(len(rows)), key=lambda index: len(rows[index]), reverse=True)
        chunks, start = [], 0
        while start < len(order):
            width = len(rows[order[start]])
            chunks.append(order[start : start + max(1, self.max_batch_tokens // width)])
            start += len(chunks[-1])
        return chunks

    def embed(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Unnormalised vectors of tokenized rows, in their order, computed here."""
        backend = self.backend
        assert not isinstance(backend, TritonBackend), "Triton runs through embed_remote"
        vectors = np.empty((len(rows), self.model.dimensions), dtype=np.float32)
        for chunk in self.passes(rows):
            vectors[chunk] = backend.pool(*pad([rows[index] for index in chunk]))
        return vectors

    async def embed_remote(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """The same on Triton, every pass in flight at once for its dynamic batcher."""
        assert isinstance(self.backend, TritonBackend)
        chunks = self.passes(rows)
        pooled = await asyncio.gather(
            *(self.backend.pool(*pad([rows[index] for index in chunk])) for chunk in chunks)
        )
        vectors = np.empty((len(rows), self.model.dimensions), dtype=np.float32)
        for chunk, values in zip(chunks, pooled, strict=True):
            vectors[chunk] = values
        return vectors

    def encode(
        self, texts: Sequence[str], *, normalize: bool = True
    ) -> tuple[np.ndarray, list[int]]:
        """Vectors of `texts` and the tokens each one used, cut at the model's maximum on
        the right, as sentence-transformers cuts them."""
        tokenized = self.tokenizer.tokenize(texts, "right")
        vectors = self.embed([each.ids for each in tokenized])
        return (normalized(vectors) if normalize else vectors), [len(t.ids) for t in tokenized]
