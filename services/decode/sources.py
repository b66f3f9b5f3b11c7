"""Which prefill workers a decode worker may pull KV from.

A KV handle names the address to pull from. Dialing whatever address a request names
would let any caller make decode connect anywhere (server-side request forgery) and keep
a channel open to each; so decode pulls only from the prefill workers it is configured
with: their targets as written, and the addresses their DNS names resolve to (a
Kubernetes headless Service name covers its pods, which put their own IP in handles).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mesh import targets


class PrefillSources:
    def __init__(
        self,
        configured: list[str],
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured = configured
        self.refresh_s = refresh_s
        self._clock = clock
        self._literal = {t for t in configured if "://" not in t and not t.startswith("ipv")}
        self._resolved: set[tuple[str, int]] = set()
        self._refreshed_at: float | None = None

    async def allows(self, address: str) -> bool:
        """Whether `address` is one of the configured prefill workers. An address not
        known yet resolves the names again, at most once per `refresh_s`, so a flood of
        made-up addresses costs no more than one lookup in that time."""
        if address in self._literal:
            return True
        try:
            pair = targets.host_port(address)
        except ValueError:
            return False
        if pair in self._resolved:
            return True
        now = self._clock()
        if self._refreshed_at is None or now - self._refreshed_at >= self.refresh_s:
            self._refreshed_at = now
            resolved: set[tuple[str, int]] = set()
            for target in self.configured:
                try:
                    resolved |= await targets.resolve(target)
                except ValueError:
                    continue
            self._resolved = resolved
        return pair in self._resolved
