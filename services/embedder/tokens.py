"""Texts to token ids the model accepts, cut the way the tokenizer itself would cut them.

The Rust `tokenizers.Tokenizer` from the model's tokenizer.json is used directly: its
`encode_batch` releases the GIL, and nothing here mutates it after loading, so threads
may share it. The file ships with truncation to 128 and padding to 128 switched on
(sentence-transformers overrides both on every call); both are switched off once at load.
Truncation then cuts only the text between the special tokens ([CLS] ... [SEP]) and adds
them back, as the tokenizer's own truncation does, so a cut input is exactly what
sentence-transformers embeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Tokenizer

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
