"""What an LLM service says of its model in GetInfo (mesh.info): the same description for
the tokenizer, prefill, decode and the router, from the checked model directory; and the
engine prefill and decode load to serve ([engines.llm] engine), described so."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from aimesh.llm.v1 import kv_cache_pb2
from mesh.artifacts import artifact_digest, sha256_of
from mesh.failures import NotReady
from mesh.info import ModelInfo
from services.llm.artifacts import DEFAULT_NAME, gguf_sha256, model_directory, resolve_model
from services.llm.engine_choice import engine_of, gguf_of
from services.llm.gguf import GgufFacts, read_facts
from services.llm.llama import Llama, LlamaConfig, resolve_device, resolve_dtype
from services.llm.memory_plan import check_fits
from services.llm.settings import LlmSettings

if TYPE_CHECKING:
    from services.llm.llama_cpp import LlamaCpp


def model_name(settings: LlmSettings) -> str:
    """What callers name the model by: its directory's name, its GGUF file's, or the
    embedded default's."""
    if settings.model is not None:
        return settings.model.name
    if settings.gguf is not None:
        return settings.gguf.stem
    return DEFAULT_NAME


def described(
    directory: Path,
    settings: LlmSettings,
    *,
    engine: str,
    dtype: str = "",
    device: torch.device | str = "",
    artifact: Path | None = None,
) -> ModelInfo:
    """`artifact`: the file the engine serves when it is not the directory (a GGUF). A
    model given as a GGUF alone is described by the GGUF (its digest, its limits) in every
    service, so all four agree which model they serve."""
    gguf = gguf_of(settings)
    if settings.gguf_only:
        digest, revision = gguf_sha256(directory), str(gguf)
    elif artifact is not None:
        digest, revision = sha256_of(artifact), str(artifact)
    else:
        digest, revision = artifact_digest(directory), str(directory)
    limits = {
        "max_seq_len": str(settings.max_seq_len),
        "max_batch_size": str(settings.max_batch_size),
        "max_new_tokens_limit": str(settings.max_new_tokens_limit),
    }
    if gguf is not None and (settings.gguf_only or engine == "llama.cpp"):
        limits |= read_facts(gguf).limits()
    if engine == "llama.cpp":
        from services.llm import llama_backend  # only a llama.cpp process loads its kernels

        limits["cpu_variant"] = llama_backend.cpu_variant()
    return ModelInfo(
        name=model_name(settings),
        revision=revision,
        sha256=digest,
        dtype=dtype,
        device=str(device),
        engine=engine,
        limits=limits,
    )


def config_of(facts: GgufFacts) -> LlamaConfig:
    """What the engines read of a model's shape, from its GGUF (the fields only the torch
    engine uses - norms, rope, projections - stay empty: it never serves a GGUF alone)."""
    return LlamaConfig(
        vocab_size=facts.vocab_size,
        hidden_size=facts.embedding_length,
        intermediate_size=0,
        num_layers=facts.num_layers,
        num_heads=facts.num_heads,
        num_kv_heads=facts.num_kv_heads,
        head_dim=max(facts.key_length, facts.value_length),
        rms_norm_eps=0.0,
        rope_theta=0.0,
        max_position_embeddings=facts.context_length,
        tie_word_embeddings=False,
        bos_token_id=facts.bos_token_id,
        eos_token_ids=facts.end_token_ids,
    )


def load_llama(settings: LlmSettings, cache_dir: Path) -> tuple[Llama, ModelInfo]:
    """The configured model on the device and in the dtype resolved on this machine, and
    its GetInfo entry. Blocking: call it in a thread."""
    if settings.gguf_only:
        assert settings.gguf is not None
        facts = read_facts(settings.gguf)
        raise NotReady(
            f"{settings.gguf.name} ({facts.architecture}) is a GGUF alone, which the llama.cpp "
            "engine serves; the torch engine needs a Hugging Face directory of a llama model "
            "(set [engines.llm] engine and prefill_engine to 'auto' or 'llama.cpp')"
        )
    torch.set_num_threads(settings.thread_count())
    directory = resolve_model(settings.model, cache_dir)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    model = Llama.load(directory, dtype, device)
    info = described(
        directory, settings, engine="torch", dtype=str(dtype).removeprefix("torch."), device=device
    )
    return model, info


@dataclass(frozen=True)
class Served:
    """The model prefill or decode serves, its GetInfo entry, the KV format it writes, and
    those it reads (decode refuses KV of any other)."""

    model: Llama | LlamaCpp
    info: ModelInfo
    kv_format: kv_cache_pb2.KvFormat
    reads: tuple[kv_cache_pb2.KvFormat, ...]


def load_served(
    settings: LlmSettings,
    cache_dir: Path,
    *,
    phase: Literal["prefill", "decode"],
    sequences: int,
) -> Served:
    """The model of `phase`'s engine, holding up to `sequences` at once (llama.cpp sizes
    its context by it). Blocking: call it in a thread."""
    if engine_of(settings, phase) == "torch":
        model, info = load_llama(settings, cache_dir)
        torch_kv = kv_cache_pb2.KvFormat(engine="torch", model_sha256=info.sha256)
        return Served(model, info, torch_kv, (torch_kv,))
    gguf = gguf_of(settings)
    if gguf is None:
        raise NotReady(
            "[engines.llm] engine = 'llama.cpp' needs gguf = <the model's GGUF> with a model "
            "directory"
        )
    # Imported here: only a llama.cpp process loads the library.
    from services.llm.llama_cpp import LlamaCpp, kv_format

    facts = read_facts(gguf)
    directory = model_directory(settings, cache_dir)
    config = config_of(facts) if settings.gguf_only else LlamaConfig.from_directory(directory)
    check_fits(facts, settings, sequences)
    model = LlamaCpp(
        gguf,
        config,
        sequences=sequences,
        max_seq_len=settings.max_seq_len,
        threads=settings.thread_count(),
    )
    info = described(
        directory,
        settings,
        engine="llama.cpp",
        dtype=model.weights_type,
        device="cpu",
        artifact=gguf,
    )
    own = kv_format(info.sha256)
    if settings.gguf_only:
        return Served(model, info, own, (own,))
    # Torch prefill's KV of the same model directory, written as llama.cpp's state on load.
    torch_kv = kv_cache_pb2.KvFormat(engine="torch", model_sha256=artifact_digest(directory))
    return Served(model, info, own, (own, torch_kv) if model.reads_torch else (own,))
