"""Incremental detokenization: token ids in, text deltas out, never half a character.

The prefix-offset method of TGI and vLLM: decode a small window that starts one step
back, so leading-space rules and tokens that split a UTF-8 character resolve against
their neighbours. A window whose text ends in U+FFFD is an unfinished character and is
held back until a later token completes it. Each step decodes a window of a few tokens,
not the whole sequence.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """The text the new ids complete; '' while a character is still unfinished."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def finish(self) -> str:
        """Whatever is still held back (a truly broken tail decodes to U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]
