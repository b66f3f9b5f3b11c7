"""What a GGUF says of its model, read by llama.cpp itself: the checks before anything loads.

A GGUF is a complete model: weights, vocabulary, special tokens, chat template and
hyperparameters. llama.cpp reads the metadata and the vocabulary without the weights
(`vocab_only`, a fraction of a second even for a large file), and a file it cannot read -
truncated, corrupt, an architecture it does not know - fails here with llama.cpp's own
reason, before a process loads weights or any service starts (services/llm/preflight.py).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llama_cpp as lib

from mesh.failures import NotReady
from services.llm import llama_backend

# Every cache element of llama.cpp's default KV types (f16 K and V).
KV_ELEMENT_BYTES = 2
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufFacts:
    """A GGUF's model as llama.cpp reads it."""

    path: Path
    file_bytes: int
    architecture: str
    name: str
    context_length: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embedding_length: int
    key_length: int
    value_length: int
    vocab_size: int
    bos_token_id: int | None
    # Every token that ends a generation (llama.cpp's end-of-generation set: EOS, EOT, EOM...).
    end_token_ids: tuple[int, ...]
    chat_template: str | None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token in llama.cpp's f16 cache. A sliding-window
        layer holds fewer tokens; counting it whole is the safe side of an estimate."""
        per_layer = self.num_kv_heads * (self.key_length + self.value_length)
        return self.num_layers * per_layer * KV_ELEMENT_BYTES

    def limits(self) -> dict[str, str]:
        """GetInfo's and /v1/models' limits of the model itself."""
        return {
            "architecture": self.architecture,
            "context_length": str(self.context_length),
            "kv_bytes_per_token": str(self.kv_bytes_per_token),
            "layers": str(self.num_layers),
            "kv_heads": str(self.num_kv_heads),
            "vocab_size": str(self.vocab_size),
            "bos_token_id": "" if self.bos_token_id is None else str(self.bos_token_id),
            "end_token_ids": ",".join(map(str, self.end_token_ids)),
            "chat_template": "yes" if self.chat_template else "no",
        }


_errors = threading.local()


@contextmanager
def llama_errors() -> Iterator[list[str]]:
    """llama.cpp's error lines logged on this thread meanwhile (why a load failed)."""
    _errors.lines = lines = []
    try:
        yield lines
    finally:
        _errors.lines = None


def note_error(text: str) -> None:
    """Called by the engine's log callback for every llama.cpp error line."""
    lines = getattr(_errors, "lines", None)
    if lines is not None:
        lines.append(text)


def read_facts(path: Path) -> GgufFacts:
    """The GGUF's facts, or NotReady naming the file and llama.cpp's reason."""
    return _read_facts(path.resolve(), *_identity(path))


def _identity(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as error:
        raise NotReady(f"{path}: cannot read the GGUF ({error.strerror})") from error
    if magic != GGUF_MAGIC:
        raise NotReady(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return stat.st_size, stat.st_mtime_ns


@contextmanager
def vocabulary_of(path: Path) -> Iterator[lib.llama_model_p]:
    """The GGUF loaded by llama.cpp without its weights, freed at the end; NotReady with
    llama.cpp's reason when it cannot read it."""
    llama_backend.start()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    with llama_errors() as errors:
        model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        reason = "; ".join(errors) or "no reason given"
        raise NotReady(f"llama.cpp cannot read {path}: {reason}")
    try:
        yield model
    finally:
        lib.llama_model_free(model)


@cache
def _read_facts(path: Path, size: int, _mtime_ns: int) -> GgufFacts:
    """Cached by path, size and modification time: a replaced file is read again."""
    with vocabulary_of(path) as model:
        return _facts(model, path, size)


def _facts(model: lib.llama_model_p, path: Path, size: int) -> GgufFacts:
    """The facts from the metadata as text: a vocab_only model has no hyperparameters
    loaded (llama_model_n_head and the like abort on it), but keeps every scalar key. A
    per-layer array (some models give head counts per layer) is not kept: a stand-in on
    the safe side of the estimate takes its place, and the engine that loads the weights
    reads the real ones."""
    vocab = lib.llama_model_get_vocab(model)
    tokens = lib.llama_vocab_n_tokens(vocab)
    arch = meta(model, "general.architecture") or "unknown"
    heads = _int_meta(model, f"{arch}.attention.head_count", 0)
    embedding = _int_meta(model, f"{arch}.embedding_length", 0)
    # Head counts given per layer (an array): one head as wide as the model stands in,
    # which is full multi-head attention's KV, the most a layer can hold.
    head_dim = embedding // heads if heads else embedding
    template = lib.llama_model_chat_template(model, None)
    bos = lib.llama_vocab_bos(vocab)
    return GgufFacts(
        path=path,
        file_bytes=size,
        architecture=arch,
        name=meta(model, "general.name") or path.stem,
        context_length=_int_meta(model, f"{arch}.context_length", 0),
        num_layers=_int_meta(model, f"{arch}.block_count", 0),
        num_heads=heads,
        num_kv_heads=_int_meta(model, f"{arch}.attention.head_count_kv", heads or 1),
        embedding_length=embedding,
        key_length=_int_meta(model, f"{arch}.attention.key_length", head_dim),
        value_length=_int_meta(model, f"{arch}.attention.value_length", head_dim),
        vocab_size=tokens,
        bos_token_id=bos if bos >= 0 else None,
        end_token_ids=tuple(t for t in range(tokens) if lib.llama_vocab_is_eog(vocab, t)),
        chat_template=template.decode() if template else None,
    )


def llama_tokenize(path: Path, texts: list[str], add_special: bool) -> list[list[int]]:
    """The texts' ids as llama.cpp itself tokenizes them with the GGUF's vocabulary
    (special tokens written in a text are parsed as such, as the tokenizer service does)."""
    with vocabulary_of(path) as model:
        vocab = lib.llama_model_get_vocab(model)
        return [_tokenize(vocab, text, add_special) for text in texts]


def token_strips(path: Path) -> dict[int, tuple[bool, bool]]:
    """(lstrip, rstrip) of every special or user-defined token, as llama.cpp reads the
    GGUF (it decides some by model, Phi-3's chat markers among them)."""
    kinds = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED
    with vocabulary_of(path) as model:
        vocab = lib.llama_model_get_vocab(model)
        attributes = (
            lib.llama_vocab_get_attr(vocab, t) for t in range(lib.llama_vocab_n_tokens(vocab))
        )
        return {
            token: (bool(a & lib.LLAMA_TOKEN_ATTR_LSTRIP), bool(a & lib.LLAMA_TOKEN_ATTR_RSTRIP))
            for token, a in enumerate(attributes)
            if a & kinds
        }


def _tokenize(vocab: lib.llama_vocab_p, text: str, add_special: bool) -> list[int]:
    data = text.encode()
    capacity = len(data) + 8
    buffer = (lib.llama_token * capacity)()
    count = lib.llama_tokenize(vocab, data, len(data), buffer, capacity, add_special, True)
    return list(buffer[:count])


def meta(model: lib.llama_model_p, key: str) -> str | None:
    """A metadata value as text, None when the GGUF has no such key."""
    size = lib.llama_model_meta_val_str(model, key.encode(), None, 0)
    if size < 0:
        return None
    buffer = ctypes.create_string_buffer(size + 1)
    lib.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer))
    return buffer.value.decode(errors="replace")


def _int_meta(model: lib.llama_model_p, key: str, default: int) -> int:
    value = meta(model, key)
    return int(value) if value and value.isdigit() else default
