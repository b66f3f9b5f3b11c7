"""MiniLM's token vectors as one torch module: what the in-process scorer runs, and what
is exported once to ONNX for Triton (k8s/triton-model-repository/token_embedding), so both
compute the same thing by construction."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel

from mesh.artifacts import build_once
from services.shared.minilm import export_onnx

ONNX_DIRECTORY = "all-MiniLM-L6-v2-tokens-onnx"
ONNX_FILE = "model.onnx"


class TokenStates(torch.nn.Module):
    """input_ids, attention_mask int64 [batch, tokens] -> last_hidden_state float32
    [batch, tokens, dimensions]; padded positions are masked out of attention, so a row's
    real tokens come out the same whatever it was padded to."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]


def load_token_states(path: Path) -> TokenStates:
    """The model's weights (float32, eval mode), loaded from its directory only."""
    transformer = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return TokenStates(transformer).eval()


def token_graph(path: Path, cache_dir: Path) -> Path:
    """The exported graph's verified path, exporting (or re-exporting a corrupt one) first:
    what a Triton deployment places at token_embedding/1/model.onnx."""
    target = cache_dir / "models" / ONNX_DIRECTORY
    build_once(target, lambda scratch: _export(path, scratch / ONNX_FILE), str(path))
    return target / ONNX_FILE


def _export(path: Path, graph: Path) -> None:
    module = load_token_states(path)
    export_onnx(
        module, graph, "token_embeddings", module.transformer.config.max_position_embeddings
    )
