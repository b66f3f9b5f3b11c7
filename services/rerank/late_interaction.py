"""minilm-late-interaction without its transformer: tokenizing, passes, and the scoring
arithmetic, shared by the in-process scorer and the one whose transformer runs on Triton,
so the two differ only in where `last_hidden_state` is computed.

A query and its documents become a `Plan`: every text's token ids (the query cut at the
model's 512 tokens, documents at `document_tokens`: their title and opening, where a
passage says what it is about; measured better than the full 256) and padded passes of at
most `pass_tokens` tokens, shortest first, so short candidates do not pay for long ones.
Given each pass's hidden states, `scores` compares every token vector ColBERT-style (each
query token's best match in the document, averaged: MaxSim) and blends that with the
pooled cosine the model was trained for. No torch here: a process whose transformer runs
on Triton never loads it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.rerank.settings import RerankSettings
from services.shared.minilm import TextTokenizer, normalized, pad


@dataclass(frozen=True)
class Pass:
    """One forward pass: which texts it holds (0 is the query) and their padded ids."""

    texts: list[int]
    input_ids: np.ndarray  # int64 [rows, width]
    attention_mask: np.ndarray  # int64 [rows, width]


@dataclass(frozen=True)
class Plan:
    """A query and its documents as the transformer sees them: query first."""

    lengths: list[int]  # tokens of each text after its cut, special tokens included
    passes: list[Pass]


class LateInteraction:
    """alpha * pooled cosine + (1 - alpha) * MaxSim over MiniLM's unit token vectors."""

    name = "minilm-late-interaction"

    def __init__(self, path: Path, settings: RerankSettings) -> None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        self.max_tokens: int = config["model_max_length"]
        self.alpha = settings.alpha
        self.pass_tokens = settings.pass_tokens
        self._queries = TextTokenizer(path, self.max_tokens)
        self._documents = TextTokenizer(path, settings.document_tokens)

    def token_count(self, query: str, document: str) -> int:
        (pair,) = self._queries.tokenize([query + " " + document], None)
        return pair.length

    def plan(self, query: str, documents: Sequence[str]) -> Plan:
        (query_ids,) = self._queries.tokenize([query], "right")
        rows = [query_ids.ids] + [t.ids for t in self._documents.tokenize(documents, "right")]
        chunks = [[0], *self._passes(rows, range(1, len(rows)))]
        return Plan(
            lengths=[len(row) for row in rows],
            passes=[Pass(chunk, *pad([rows[i] for i in chunk])) for chunk in chunks],
        )

    def _passes(self, rows: Sequence[Sequence[int]], indices: range) -> list[list[int]]:
        """Shortest first, as many rows a pass as fit `pass_tokens` once padded to its
        longest (always at least one)."""
        chunks: list[list[int]] = []
        chunk: list[int] = []
        for index in sorted(indices, key=lambda i: len(rows[i])):
            if chunk and (len(chunk) + 1) * len(rows[index]) > self.pass_tokens:
                chunks.append(chunk)
                chunk = []
            chunk.append(index)
        if chunk:
            chunks.append(chunk)
        return chunks

    def scores(self, plan: Plan, hidden: Sequence[np.ndarray]) -> list[float]:
        """One score per document from each pass's last_hidden_state [rows, width, dim]."""
        states: list[np.ndarray] = [np.empty(0)] * len(plan.lengths)
        for one_pass, output in zip(plan.passes, hidden, strict=True):
            for row, index in enumerate(one_pass.texts):
                states[index] = normalized(output[row, : plan.lengths[index]])
        query, *documents = states
        query_vector = normalized(query.mean(axis=0, keepdims=True))[0]
        query_tokens = _body(query)
        pooled = normalized(np.stack([document.mean(axis=0) for document in documents]))
        scores = []
        for cosine, document in zip(pooled @ query_vector, documents, strict=True):
            maxsim = (query_tokens @ _body(document).T).max(axis=-1).mean()
            scores.append(float(self.alpha * cosine + (1 - self.alpha) * maxsim))
        return scores

    @staticmethod
    def to_unit(scores: list[float]) -> list[float]:
        return [(s + 1.0) / 2.0 for s in scores]  # cosine-like, in [-1, 1]


def _body(states: np.ndarray) -> np.ndarray:
    """A text's token vectors without [CLS] and [SEP], unless that would leave none."""
    return states[1:-1] if len(states) > 2 else states
