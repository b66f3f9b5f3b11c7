"""What an LLM service says of its model in GetInfo (mesh.info): the same description for
the tokenizer, prefill, decode and the router, from the checked model directory; and the
model prefill and decode load to serve, described so."""

from __future__ import annotations

from pathlib import Path

import torch

from mesh.artifacts import artifact_digest
from mesh.info import ModelInfo
from services.llm.artifacts import DEFAULT_NAME, resolve_model
from services.llm.llama import Llama, resolve_device, resolve_dtype
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


def load_llama(settings: LlmSettings, cache_dir: Path) -> tuple[Llama, ModelInfo]:
    """The configured model on the device and in the dtype resolved on this machine, and
    its GetInfo entry. Blocking: call it in a thread."""
    torch.set_num_threads(settings.threads)
    directory = resolve_model(settings.model, cache_dir)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    model = Llama.load(directory, dtype, device)
    return model, described(directory, settings, engine="torch", dtype=dtype, device=device)
