"""Relevance scorers: how rerank turns (query, document) into a score. No grpc here.

No trained cross-encoder ships in any package this project can install, so the embedded
default is named for what it is: `minilm-late-interaction`, all-MiniLM-L6-v2's token
vectors compared ColBERT-style (each query token's best match in the document, averaged:
MaxSim) and blended with the pooled cosine the model was trained for. Measured on the
labelled stdlib questions (docs/benchmarks.md), it lifts nDCG@10 over hybrid retrieval
where an off-the-shelf 135M LLM's query likelihood (UPR) made it worse. A real
cross-encoder, from a local directory, replaces it by configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from mesh.failures import FieldViolation, InvalidInput


class Scorer(Protocol):
    name: str
    max_tokens: int

    def token_count(self, query: str, document: str) -> int: ...

    def score(self, query: str, documents: list[str]) -> list[float]:
        """Native scores, higher = more relevant; blocking, run on the model thread."""

    def to_unit(self, scores: list[float]) -> list[float]:
        """Scores mapped into [0, 1] for callers that did not ask for raw ones."""


@dataclass
class LateInteractionScorer:
    """MiniLM token vectors: alpha * pooled cosine + (1 - alpha) * MaxSim.

    Documents are read up to `document_tokens` (their title and opening, where a passage
    says what it is about; measured better than the full 256) in passes of at most
    `pass_tokens` padded tokens, shortest first, so short candidates do not pay for long
    ones.
    """

    path: Path
    alpha: float = 0.3
    document_tokens: int = 128
    pass_tokens: int = 2048
    name: str = "minilm-late-interaction"

    def __post_init__(self) -> None:
        from transformers import AutoModel, AutoTokenizer  # seconds to import: load time only

        self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        self._model = AutoModel.from_pretrained(self.path).eval()
        self.max_tokens = self._tokenizer.model_max_length

    def token_count(self, query: str, document: str) -> int:
        return len(self._tokenizer(query + " " + document)["input_ids"])

    @torch.inference_mode()
    def _vectors(self, texts: list[str], limit: int) -> list[torch.Tensor]:
        """Unit-length token vectors of each text, special tokens included."""
        encoded = self._tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
        vectors: list[torch.Tensor] = [torch.empty(0)] * len(texts)
        batch: list[int] = []

        def run() -> None:
            padded = self._tokenizer.pad(
                {"input_ids": [encoded[i] for i in batch]}, return_tensors="pt"
            )
            states = F.normalize(self._model(**padded).last_hidden_state, dim=-1)
            for row, index in enumerate(batch):
                vectors[index] = states[row, : len(encoded[index])]

        for index in order:
            if batch and (len(batch) + 1) * len(encoded[index]) > self.pass_tokens:
                run()
                batch = []
            batch.append(index)
        if batch:
            run()
        return vectors

    def score(self, query: str, documents: list[str]) -> list[float]:
        (query_states,) = self._vectors([query], self.max_tokens)
        query_vector = F.normalize(query_states.mean(0), dim=0)
        query_tokens = query_states[1:-1] if len(query_states) > 2 else query_states
        scores = []
        for states in self._vectors(documents, self.document_tokens):
            pooled = float(query_vector @ F.normalize(states.mean(0), dim=0))
            body = states[1:-1] if len(states) > 2 else states
            maxsim = float((query_tokens @ body.T).max(dim=-1).values.mean())
            scores.append(self.alpha * pooled + (1 - self.alpha) * maxsim)
        return scores

    def to_unit(self, scores: list[float]) -> list[float]:
        return [(s + 1.0) / 2.0 for s in scores]  # cosine-like, in [-1, 1]


@dataclass
class CrossEncoderScorer:
    """Any sentence-transformers CrossEncoder directory (or ONNX export of one)."""

    path: Path

    def __post_init__(self) -> None:
        from sentence_transformers import CrossEncoder  # load time only

        self._model = CrossEncoder(str(self.path), device="cpu")
        self.name = self.path.name
        self.max_tokens = self._model.max_length or 512

    def token_count(self, query: str, document: str) -> int:
        return len(self._model.tokenizer(query, document)["input_ids"])

    def score(self, query: str, documents: list[str]) -> list[float]:
        logits = self._model.predict(
            [(query, d) for d in documents], activation_fn=torch.nn.Identity()
        )
        return [float(x) for x in logits]

    def to_unit(self, scores: list[float]) -> list[float]:
        return [float(torch.sigmoid(torch.tensor(s))) for s in scores]


def check_lengths(scorer: Scorer, query: str, documents: list[str]) -> None:
    """Without `truncate`, a pair over the model's length is refused, never silently cut."""
    too_long = [
        FieldViolation(
            f"documents[{i}].text",
            f"query + document is {n} tokens, over the scorer's {scorer.max_tokens}; "
            "set truncate to cut it",
        )
        for i, document in enumerate(documents)
        if (n := scorer.token_count(query, document)) > scorer.max_tokens
    ]
    if too_long:
        raise InvalidInput(too_long[:16])
