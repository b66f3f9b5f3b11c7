"""Logprobs as OpenAI shows them: each generated token's bytes and text beside the
log-probability the engine sent for it, and the same for the most likely alternatives.

A token's exact bytes come from llguidance's reading of the model's tokenizer.json (the
reading the constraint masks use), not from decoding the token alone with `tokenizers`:
a byte-level token that holds half a character decodes to U+FFFD there, and its bytes
would be lost. Concatenated, the generated tokens' bytes are then the output's text.
"""

from __future__ import annotations

import threading
import weakref

import llguidance
from tokenizers import Tokenizer

from aimesh.llm.v1 import decode_pb2, generation_pb2, sampling_pb2

# llguidance marks a special token's bytes with this leading byte, never valid UTF-8.
_SPECIAL = 0xFF


class TokenPieces:
    """Token id -> (bytes, text) for one tokenizer, read on first use: ~0.4 s for a 49k
    vocabulary, which a router that never sees a logprobs request need not pay."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._reader: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # Read once each: a streamed answer meets the same few thousand tokens again and
        # again, and at batch 16 with alternatives the reads were a router's hot spot.
        self._pieces: dict[int, tuple[bytes, str]] = {}

    def load(self) -> None:
        """Blocking the first time: call it off the event loop."""
        with self._lock:
            if self._reader is None:
                self._reader = llguidance.LLTokenizer(self._tokenizer.to_str())

    def piece(self, token_id: int) -> tuple[bytes, str]:
        """The token's bytes and their text (U+FFFD for part of a character); a special
        token is its name."""
        if (known := self._pieces.get(token_id)) is not None:
            return known
        self._pieces[token_id] = piece = self._read(token_id)
        return piece

    def _read(self, token_id: int) -> tuple[bytes, str]:
        self.load()
        assert self._reader is not None
        if token_id >= self._reader.vocab_size:  # a padded output row no text maps to
            return b"", ""
        raw = self._reader.decode_bytes([token_id])
        if raw[:1] == bytes([_SPECIAL]):
            name = self._tokenizer.id_to_token(token_id) or ""
            return name.encode(), name
        return raw, raw.decode("utf-8", errors="replace")

    def entries(self, chunk: decode_pb2.TokenChunk) -> list[generation_pb2.TokenLogprob]:
        """One TokenLogprob per token of an engine's chunk."""
        tops = list(chunk.top_logprobs) or [sampling_pb2.TopLogprobs()] * len(chunk.token_ids)
        entries = []
        for token_id, logprob, top in zip(chunk.token_ids, chunk.logprobs, tops, strict=True):
            raw, text = self.piece(token_id)
            alternatives = []
            for other, other_logprob in zip(top.token_ids, top.logprobs, strict=True):
                other_raw, other_text = self.piece(other)
                alternatives.append(
                    generation_pb2.TopLogprob(
                        token_id=other, token=other_text, bytes=other_raw, logprob=other_logprob
                    )
                )
            entries.append(
                generation_pb2.TokenLogprob(
                    token_id=token_id,
                    token=text,
                    bytes=raw,
                    logprob=logprob,
                    top_logprobs=alternatives,
                )
            )
        return entries


# One TokenPieces per loaded tokenizer: registered versions of one vocabulary share their
# tokenizer (services/generation/versions.py), and so its pieces, read once.
_SHARED: weakref.WeakKeyDictionary[Tokenizer, TokenPieces] = weakref.WeakKeyDictionary()


def pieces_of(tokenizer: Tokenizer) -> TokenPieces:
    """The pieces of `tokenizer`, shared by every pool that serves with it."""
    pieces = _SHARED.get(tokenizer)
    if pieces is None:
        _SHARED[tokenizer] = pieces = TokenPieces(tokenizer)
    return pieces
