"""Text, made once: the router turns a generation's ids into text and cuts it at stop
strings, whichever engine generated the ids.

Ids become text through the `tokenizers` library's DecodeStream with the model's own
tokenizer.json: a character whose bytes span several tokens (byte-level BPE, byte-fallback
tokens) comes out whole with the token that completes it, never as half a character.

Stop strings are matched on that text, by character: the text before the first match is
emitted and the match and everything after it never is. Only the end of the text that
could still be the start of a stop string is held back; the rest goes out at once.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    """One generation's text: ids in, text deltas out, until a stop string appears."""

    def __init__(self, tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stops = stop_sequences
        self._longest = max(map(len, stop_sequences), default=0)
        # Ids DecodeStream has not turned into text yet (a character still unfinished),
        # and the ids of the last step that gave text: what finish() decodes them after.
        self._pending: list[int] = []
        self._context: list[int] = []
        self._held = ""
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """The text now safe to show; empty while a character or a possible stop string
        is unfinished, and once a stop string appeared."""
        if self.stopped:
            return ""
        self._pending += ids
        piece = self._decoder.step(self._tokenizer, ids)
        if piece is None:
            return ""
        self._context, self._pending = self._pending, []
        return self._cut(piece)

    def finish(self) -> str:
        """What is left once no more ids come: held text, and an unfinished character as
        U+FFFD (as a one-shot decode of every id shows it)."""
        if self.stopped:
            return ""
        tail = ""
        if self._pending:
            before = self._decode(self._context)
            after = self._decode(self._context + self._pending)
            tail = after[len(before) :] if after.startswith(before) else self._decode(self._pending)
            self._pending = []
        text = self._cut(tail) + self._held  # none is held once a stop string appeared
        self._held = ""
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _cut(self, piece: str) -> str:
        text = self._held + piece
        matches = [at for stop in self._stops if (at := text.find(stop)) >= 0]
        if matches:
            self.stopped = True
            self._held = ""
            return text[: min(matches)]
        cut = len(text)  # held back from here: the longest end a stop string starts with
        for k in range(min(len(text), self._longest - 1), 0, -1):
            if any(stop.startswith(text[-k:]) for stop in self._stops):
                cut = len(text) - k
                break
        self._held = text[cut:]
        return text[:cut]
