"""The transformer and its mean pooling as one torch module: what the torch backend runs
and what the ONNX backend exports, so both compute the same thing by construction."""

from __future__ import annotations

import torch
from transformers import AutoModel

from services.embedder.model import SentenceModel


class MeanPooled(torch.nn.Module):
    """input_ids, attention_mask [batch, tokens] -> unnormalised [batch, dimensions].

    Mean over the tokens the mask keeps, as sentence-transformers' Pooling computes it
    (the divisor clamped at 1e-9), so padding never changes a row's vector.
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        return (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def load_pooled(model: SentenceModel) -> MeanPooled:
    """The model's weights (safetensors, float32, eval mode), loaded from its directory only."""
    transformer = AutoModel.from_pretrained(model.path, local_files_only=True, dtype=torch.float32)
    return MeanPooled(transformer).eval()
