"""Idempotency keys: a repeated call returns the first call's result instead of running.

Own code, not a cache library: besides expiry it must let a second call with the same
key wait for a first one still running, and refuse a key reused for different arguments.
Keys are scoped by the calling client (mesh.caller), so one client's key never replays
another's result. Every entry lives the same window, so insertion order is expiry order: expiring
pops from the front (O(1) amortised) and the size bound evicts the oldest first. An
evicted or expired entry whose call still runs is only forgotten by the store; its
caller settles the Entry it holds, so the calls already waiting on it still get the result.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aimesh.tools.v1 import tools_pb2
from mesh.failures import AlreadyExists

MAX_KEY_BYTES = 128

Slot = tuple[str, str]  # (client, key)


@dataclass(eq=False)
class Entry:
    slot: Slot
    call: str  # digest of the tool name + canonical arguments
    result: asyncio.Future[tools_pb2.CallToolResult | None]
    expires: float


class IdempotencyKeys:
    def __init__(
        self, window_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[Slot, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._entries.popitem(last=False)

    def claim(self, client: str, key: str, call: str) -> tuple[Entry, bool]:
        """(entry, True): this call runs and must `settle(entry, ...)`. (entry, False): an
        earlier call with the key in this client's scope; await asyncio.shield(entry.result)
        (shielded: one waiter cancelled must not cancel the others), and claim again if it
        gives None (that call failed)."""
        self._expire()
        slot = (client, key)
        entry = self._entries.get(slot)
        if entry is not None:
            if entry.call != call:
                raise AlreadyExists(
                    "this idempotency_key was used for a different tool call in the last "
                    f"{self.window_s:g} s; use a new key"
                )
            return entry, False
        loop = asyncio.get_running_loop()
        entry = Entry(slot, call, loop.create_future(), self._clock() + self.window_s)
        self._entries[slot] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry, True

    def settle(self, entry: Entry, result: tools_pb2.CallToolResult | None) -> None:
        """Records the outcome; only a successful result is replayed, so a failed or
        cancelled call can be retried with the same key."""
        if not entry.result.done():
            entry.result.set_result(result)
        if result is None and self._entries.get(entry.slot) is entry:
            del self._entries[entry.slot]
