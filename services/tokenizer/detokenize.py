"""Incremental detokenization: token ids in, text deltas out, never half a character.

What the tokenizer service's DetokenizeStream runs, public API for callers with ids of
their own; it lives here because nothing else uses it (the router makes a generation's
text itself, services/generation/text.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns ids arriving in pieces into text deltas, as TGI and vLLM do (prefix offsets).

    Decoding ids one by one is wrong twice over: byte-level BPE splits characters across
    tokens, and SentencePiece-style decoders drop the leading space of whatever they decode
    first. So each step decodes a window that starts a little before the new ids (at
    prefix_offset) twice, without and with the ids not yet emitted (from read_offset), and
    emits the difference. A window whose text ends with U+FFFD stops inside a character: it
    is held back until more ids complete it, or flushed as U+FFFD by finish().

    Ids before prefix_offset are never decoded again, so they are dropped: the window holds
    only the last emitted step and what is held back, and each step costs O(that), not
    O(all ids). The window grows only while text is held back, i.e. while the ids do not
    form valid UTF-8.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._window: list[int] = []  # the ids from prefix_offset on
        self._read_offset = 0  # in the window: the first id not yet emitted as text

    def push(self, ids: Iterable[int]) -> str:
        """The text `ids` complete; empty while a character is still unfinished."""
        self._window.extend(ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """Whatever is held back, an unfinished character becoming U+FFFD."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[: self._read_offset])
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHARACTER) and not final:
            return ""
        # prefix_offset moves to the old read_offset and read_offset to the end.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return text[len(prefix_text) :]
