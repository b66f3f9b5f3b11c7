"""What an LLM service says of its model in GetInfo (mesh.info): the same description for
the tokenizer, prefill, decode and the router, from the checked model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from mesh.artifacts import artifact_digest
from mesh.info import ModelInfo
from services.llm.artifacts import DEFAULT_NAME
from services.llm.settings import LlmSettings


def described(
    directory: Path,
    settings: LlmSettings,
    *,
    engine: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "",
) -> ModelInfo:
    return ModelInfo(
        name=settings.model.name if settings.model else DEFAULT_NAME,
        revision=str(directory),
        sha256=artifact_digest(directory),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "",
        device=str(device),
        engine=engine,
        limits={
            "max_seq_len": str(settings.max_seq_len),
            "max_batch_size": str(settings.max_batch_size),
            "max_new_tokens_limit": str(settings.max_new_tokens_limit),
        },
    )
