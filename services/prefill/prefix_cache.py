"""Prefill's prefix cache: the KV of recent prompts, so that a prompt sharing a prefix with
one of them (an agent's system prompt and tool list, a chat template's preamble, RAG
instructions) computes only what follows it.

An entry is a whole prompt's KV, as prefill made it. A lookup finds the entry sharing the
longest prefix with the new prompt (block hashes narrow it down, then the tokens
themselves decide, so a hash collision costs a miss, never wrong KV) and the engine
keeps that many of its tokens. Bounded by bytes, least recently used evicted first.

Every entry belongs to a cache scope (services/llm/prefix.py: the caller's client and the
request's cache_salt) and is found only by a prompt of the same scope: the block chains
start from it, and a found entry's scope is compared with the prompt's as its tokens are,
so not even a hash collision can hand one tenant another's KV, its hit count or its
speed.
Entries share their bytes with the leases made from the same prefill (bytes and tensors
are never written after prefill), so caching a prompt costs no copy.

Only the model thread touches it: no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.llm import metrics
from services.llm.kv_codec import KvState, kv_nbytes
from services.llm.prefix import BLOCK_TOKENS, UNSCOPED, block_hashes


@dataclass(eq=False)
class _Entry:
    scope: int
    tokens: tuple[int, ...]
    kv: KvState
    nbytes: int
    hashes: list[int]


@dataclass(frozen=True)
class Hit:
    """`tokens` leading prompt tokens whose KV is the first `tokens` of `entry.kv`."""

    entry: _Entry
    tokens: int

    @property
    def kv(self) -> KvState:
        return self.entry.kv


def _common_prefix(left: tuple[int, ...], right: list[int], limit: int) -> int:
    length = 0
    for a, b in zip(left[:limit], right[:limit], strict=False):
        if a != b:
            break
        length += 1
    return length


class PrefixCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        # Least recently used first.
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], _Entry] = OrderedDict()
        # Block hash -> the entries whose prompt has that block chain (dict as ordered set).
        self._holders: dict[int, dict[_Entry, None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self,
        token_ids: list[int],
        scope: int = UNSCOPED,
        usable: Callable[[int], int] | None = None,
    ) -> Hit | None:
        """The cached prompt of `scope` sharing the longest prefix (at least one block)
        with `token_ids`, up to all but its last token, whose logits prefill must compute;
        `usable` cuts the shared tokens to those prefill will use (services/llm/passes.py),
        and the hit counts only those."""
        metrics.PREFIX_CACHE_QUERIES.inc(len(token_ids))
        limit = len(token_ids) - 1
        found: _Entry | None = None
        for chain in block_hashes(token_ids, limit // BLOCK_TOKENS, scope):
            holders = self._holders.get(chain)
            if not holders:
                break
            found = next(iter(holders))
        if found is None or found.scope != scope:
            return None
        matched = _common_prefix(found.tokens, token_ids, limit)
        if matched < BLOCK_TOKENS:  # a hash collision
            return None
        if usable is not None and not (matched := usable(matched)):
            return None
        self._entries.move_to_end((scope, found.tokens))
        metrics.PREFIX_CACHE_HITS.inc(matched)
        return Hit(found, matched)

    def insert(
        self, token_ids: list[int], kv: KvState, hit: Hit | None = None, scope: int = UNSCOPED
    ) -> None:
        """Caches a prompt's KV in `scope`; a `hit` this prompt extends (its every token
        matched) is dropped, since the new entry holds all of it."""
        tokens = tuple(token_ids)
        if hit is not None and tokens[: len(hit.entry.tokens)] == hit.entry.tokens:
            self._remove(hit.entry)
        nbytes = kv_nbytes(kv)
        if len(tokens) < BLOCK_TOKENS or nbytes > self.capacity_bytes:
            return
        key = (scope, tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        while self.used_bytes + nbytes > self.capacity_bytes:
            self._remove(next(iter(self._entries.values())))
            metrics.PREFIX_CACHE_EVICTIONS.inc()
        entry = _Entry(scope, tokens, kv, nbytes, block_hashes(token_ids, scope=scope))
        self._entries[key] = entry
        for chain in entry.hashes:
            self._holders.setdefault(chain, {})[entry] = None
        self.used_bytes += nbytes
        metrics.PREFIX_CACHE_BYTES.set(self.used_bytes)

    def discard(self, hit: Hit) -> None:
        """Forgets the entry of a hit (one whose KV would not load)."""
        self._remove(hit.entry)

    def _remove(self, entry: _Entry) -> None:
        if self._entries.pop((entry.scope, entry.tokens), None) is None:
            return
        for chain in entry.hashes:
            holders = self._holders[chain]
            del holders[entry]
            if not holders:
                del self._holders[chain]
        self.used_bytes -= entry.nbytes
        metrics.PREFIX_CACHE_BYTES.set(self.used_bytes)
