"""Relevance scorers: how rerank turns (query, document) into a score. No grpc here.

No trained cross-encoder ships in any package this project can install, so the embedded
default is named for what it is: `minilm-late-interaction`, all-MiniLM-L6-v2's token
vectors compared ColBERT-style (each query token's best match in the document, averaged:
MaxSim) and blended with the pooled cosine the model was trained for. Measured on the
labelled stdlib questions (docs/benchmarks.md), it lifts nDCG@10 over hybrid retrieval
where an off-the-shelf 135M LLM's query likelihood (UPR) made it worse. A real
cross-encoder, from a local directory, replaces it by configuration.

The scorers here run in this process, blocking, on the model thread; the late-interaction
scorer whose transformer runs on Triton is in triton_scorer.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mesh.failures import FieldViolation
from services.rerank.late_interaction import LateInteraction
from services.rerank.settings import RerankSettings


class TokenLimited(Protocol):
    max_tokens: int

    def token_count(self, query: str, document: str) -> int: ...


class Scorer(TokenLimited, Protocol):
    name: str

    def score(self, query: str, documents: list[str]) -> list[float]:
        """Native scores, higher = more relevant; blocking, run on the model thread."""

    def to_unit(self, scores: list[float]) -> list[float]:
        """Scores mapped into [0, 1] for callers that did not ask for raw ones."""


class LateInteractionScorer(LateInteraction):
    """minilm-late-interaction with its transformer on torch, in this process."""

    def __init__(self, path: Path, settings: RerankSettings) -> None:
        # torch and transformers take seconds to import: load time only, and never in a
        # process whose transformer runs on Triton.
        import torch

        from services.rerank.token_model import load_token_states

        super().__init__(path, settings)
        self._torch = torch
        self._model = load_token_states(path)

    def score(self, query: str, documents: list[str]) -> list[float]:
        plan = self.plan(query, documents)
        with self._torch.inference_mode():
            hidden = [
                self._model(
                    self._torch.from_numpy(one_pass.input_ids),
                    self._torch.from_numpy(one_pass.attention_mask),
                ).numpy()
                for one_pass in plan.passes
            ]
        return self.scores(plan, hidden)


@dataclass
class CrossEncoderScorer:
    """Any sentence-transformers CrossEncoder directory (or ONNX export of one)."""

    path: Path

    def __post_init__(self) -> None:
        import torch  # load time only, as above
        from sentence_transformers import CrossEncoder

        self._torch = torch
        self._model = CrossEncoder(str(self.path), device="cpu")
        self.name = self.path.name
        self.max_tokens = self._model.max_seq_length or 512

    def token_count(self, query: str, document: str) -> int:
        return len(self._model.tokenizer(query, document)["input_ids"])

    def score(self, query: str, documents: list[str]) -> list[float]:
        logits = self._model.predict(
            [(query, d) for d in documents], activation_fn=self._torch.nn.Identity()
        )
        return [float(x) for x in logits]

    def to_unit(self, scores: list[float]) -> list[float]:
        return [float(self._torch.sigmoid(self._torch.tensor(s))) for s in scores]


def over_length(
    scorer: TokenLimited, query: str, documents: Sequence[str], first: int = 0
) -> list[FieldViolation]:
    """Without `truncate`, a pair over the model's length is refused, never silently cut:
    a violation for each, `documents` being the request's from index `first` on."""
    return [
        FieldViolation(
            f"documents[{first + i}].text",
            f"query + document is {n} tokens, over the scorer's {scorer.max_tokens}; "
            "set truncate to cut it",
        )
        for i, document in enumerate(documents)
        if (n := scorer.token_count(query, document)) > scorer.max_tokens
    ]
