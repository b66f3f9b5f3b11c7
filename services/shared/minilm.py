"""MiniLM's pure helpers, shared by the embedder and rerank: texts to token ids, padded
batches, unit-norm rows, and the one way a (input_ids, attention_mask) torch module is
exported to ONNX. No grpc and no servicer here; torch is imported only by `export_onnx`.

Tokenizing: the Rust `tokenizers.Tokenizer` from the model's tokenizer.json is used
directly: its `encode_batch` releases the GIL, and nothing here mutates it after loading,
so threads may share it. The file ships with truncation to 128 and padding to 128 switched
on (sentence-transformers overrides both on every call); both are switched off once at
load. Truncation then cuts only the text between the special tokens ([CLS] ... [SEP]) and
adds them back, as the tokenizer's own truncation does, so a cut input is exactly what
sentence-transformers embeds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from tokenizers import Tokenizer

if TYPE_CHECKING:
    import torch

OPSET = 18  # torch's dynamo exporter's own opset: no version conversion after export
# "right" keeps the beginning, "left" keeps the end (transformers' truncation_side).
Side = Literal["right", "left"]


@dataclass(frozen=True)
class Tokenized:
    """One text's ids as the model sees them, and how many tokens it had before any cut."""

    ids: list[int]
    length: int  # special tokens included


class TextTokenizer:
    """The model's fast tokenizer with a fixed maximum length; safe to share between threads."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._special = self._tokenizer.num_special_tokens_to_add(is_pair=False)
        self.max_tokens = max_tokens

    def tokenize(self, texts: Sequence[str], cut: Side | None) -> list[Tokenized]:
        """Ids of every text; with `cut`, those longer than max_tokens lose that side."""
        tokenized = []
        for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False):
            length = len(encoding.ids) + self._special
            if cut is not None and length > self.max_tokens:
                encoding.truncate(self.max_tokens - self._special, direction=cut)
            tokenized.append(Tokenized(self._tokenizer.post_process(encoding).ids, length))
        return tokenized


def pad(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) as int64 [rows, longest], padded on the right with 0
    ([PAD] in BERT vocabularies; masked out either way)."""
    width = max(len(row) for row in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
        mask[index, : len(row)] = 1
    return ids, mask


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (a zero row stays zero), as torch's F.normalize does."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def export_onnx(module: torch.nn.Module, path: Path, output: str, max_tokens: int) -> None:
    """A module of (input_ids, attention_mask) through torch.onnx's dynamo exporter, batch
    and sequence axes dynamic, weights inside the one file (90 MB for MiniLM, far below
    protobuf's 2 GB limit), so an artifact manifest covers one file."""
    import torch

    # The exporter's optimizer logs each of its hundreds of rewrites at INFO.
    for name in ("onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.WARNING)
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens", max=max_tokens)
    # Two distinct tensors: the exporter would take one tensor passed twice for one input.
    example = (torch.ones((2, 8), dtype=torch.int64), torch.ones((2, 8), dtype=torch.int64))
    torch.onnx.export(
        module,
        example,
        str(path),
        input_names=["input_ids", "attention_mask"],
        output_names=[output],
        dynamic_shapes={
            "input_ids": {0: batch, 1: tokens},
            "attention_mask": {0: batch, 1: tokens},
        },
        opset_version=OPSET,
        external_data=False,
        verbose=False,
    )
