"""Idempotency keys: a repeated call returns the first call's result instead of running.

Own code, not a cache library: besides expiry it must let a second call with the same
key wait for a first one still running, and refuse a key reused for different arguments.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aimesh.tools.v1 import tools_pb2
from mesh.failures import AlreadyExists

MAX_KEY_BYTES = 128


@dataclass
class Entry:
    call: str  # tool name + canonical arguments
    result: asyncio.Future[tools_pb2.CallToolResult | None]
    expires: float


class IdempotencyKeys:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._entries: dict[str, Entry] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            del self._entries[key]

    def claim(self, key: str, call: str) -> Entry | None:
        """None: this call runs, and must `settle` the key. An Entry: an earlier call with
        the key; await its result (None if it failed, then run again)."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None or (entry.result.done() and entry.result.result() is None):
            loop = asyncio.get_running_loop()
            self._entries[key] = Entry(call, loop.create_future(), time.monotonic() + self.window_s)
            return None
        if entry.call != call:
            raise AlreadyExists(
                "this idempotency_key was used for a different tool call in the last "
                f"{self.window_s:g} s; use a new key"
            )
        return entry

    def settle(self, key: str, result: tools_pb2.CallToolResult | None) -> None:
        """Records the outcome; only a successful result is replayed, so a failed or
        cancelled call can be retried with the same key."""
        entry = self._entries.get(key)
        if entry is not None and not entry.result.done():
            entry.result.set_result(result)
            if result is None:
                del self._entries[key]
