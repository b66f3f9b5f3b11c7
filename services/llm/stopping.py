"""When generation ends, and which tokens may be shown before it does.

Stop sequences are never emitted: text that could still turn into a stop sequence is held
back until it cannot, and when a stop sequence appears, the tokens that form it are
dropped. Matching works on whole tokens, so a token that carries text before the stop
sequence is dropped with it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


class Finish(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"


@dataclass
class StopChecker:
    max_new_tokens: int
    eos_ids: frozenset[int]
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Text of one token given the tokens before it (an incremental detokenizer's step).
    token_text: Callable[[int], str] = field(default=lambda _: "")
    generated: int = 0
    finish: Finish | None = None
    _held: list[tuple[int, str]] = field(default_factory=list)

    def feed(self, token: int, *, room_left: bool = True) -> list[int]:
        """Takes one generated token; returns the tokens now safe to emit, in order.

        `room_left` is False when the sequence has reached the context window.
        """
        if self.finish is not None:
            return []
        self.generated += 1
        if token in self.eos_ids and not self.ignore_eos:
            self.finish = Finish.EOS
            return self._flush()
        if self.stop_sequences:
            self._held.append((token, self.token_text(token)))
            text = "".join(piece for _, piece in self._held)
            if any(stop in text for stop in self.stop_sequences):
                self.finish = Finish.STOP_SEQUENCE
                self._held = []
                return []
            safe = self._release(text)
        else:
            safe = [token]
        if self.generated >= self.max_new_tokens or not room_left:
            self.finish = Finish.LENGTH
            return safe + self._flush()
        return safe

    def _release(self, text: str) -> list[int]:
        """Emits held tokens from the front while what stays behind still covers every
        suffix of the text that could begin a stop sequence.

        A token with no text yet (half of a multi-byte character) is only released with
        the token that completes it.
        """
        hold = max(
            (
                k
                for stop in self.stop_sequences
                for k in range(1, len(stop))
                if text.endswith(stop[:k])
            ),
            default=0,
        )
        keep_from = len(text) - hold
        releasable = 0
        offset = 0
        for i, (_, piece) in enumerate(self._held):
            offset += len(piece)
            if offset > keep_from:
                break
            if piece:
                releasable = i + 1
        released = [token for token, _ in self._held[:releasable]]
        del self._held[:releasable]
        return released

    def _flush(self) -> list[int]:
        held = [token for token, _ in self._held]
        self._held = []
        return held
