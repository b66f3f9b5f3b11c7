"""When decode ends a generation: at the end-of-sequence token or at the length.

Stop sequences are text, and text is the router's (services/generation/text.py): it
cancels the decode stream when one appears. Decode stops only on ids.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Finish(enum.Enum):
    LENGTH = "length"
    EOS = "eos"


@dataclass
class StopChecker:
    max_new_tokens: int
    eos_ids: frozenset[int]
    ignore_eos: bool = False
    generated: int = 0
    finish: Finish | None = None

    def feed(self, token: int, *, room_left: bool = True) -> list[int]:
        """Takes one generated token; returns it unless it ends the generation as the
        end-of-sequence token (never emitted). `room_left` is False when the sequence has
        reached the context window."""
        if self.finish is not None:
            return []
        self.generated += 1
        if token in self.eos_ids and not self.ignore_eos:
            self.finish = Finish.EOS
            return []
        if self.generated >= self.max_new_tokens or not room_left:
            self.finish = Finish.LENGTH
        return [token]
