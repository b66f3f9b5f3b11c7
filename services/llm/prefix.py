"""Prompt prefixes as chains of block hashes, the key both prefill's prefix cache and the
router's prefix-aware pick use (vLLM's and SGLang's idea: a block's hash covers every
token before it, so equal hashes at block i mean equal prompts up to block i's end).

A chain starts from its cache scope, as vLLM's starts from a request's `cache_salt`: a
cached prefix is a side channel (its hit count and its speed tell a caller that somebody
sent that prefix), so prompts of different tenants, or of different salts, make different
chains and can never share a cached block.

Python's hash of a tuple of ints is not salted per process, so the chain is the same in
every process of one Python version; the scope is a sha256, the same everywhere.
"""

from __future__ import annotations

import hashlib

# Tokens per block: small enough that a shared system prompt loses at most 15 tokens to
# the block edge, large enough that a 2,048-token prompt is 128 hashes.
BLOCK_TOKENS = 16
# A request's cache_salt, at most (vLLM takes any non-empty string; a bound keeps it out
# of memory's way).
MAX_CACHE_SALT_BYTES = 256
# The scope of prompts nobody scoped: a mesh of one tenant, or the mesh's own calls.
UNSCOPED = 0


def cache_scope(client: str, cache_salt: str) -> int:
    """The root of the block chains of a client's prompts with `cache_salt` (64 bits of a
    sha256 over both, NUL-separated: no client/salt pair reads as another)."""
    if not client and not cache_salt:
        return UNSCOPED
    digest = hashlib.sha256(f"{client}\0{cache_salt}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def block_hashes(
    token_ids: list[int], limit: int | None = None, scope: int = UNSCOPED
) -> list[int]:
    """The chain hash at the end of each whole block of `token_ids` (at most `limit`),
    the chain rooted at `scope`."""
    whole = len(token_ids) // BLOCK_TOKENS
    if limit is not None:
        whole = min(whole, limit)
    hashes: list[int] = []
    chain = scope
    for block in range(whole):
        start = block * BLOCK_TOKENS
        chain = hash((chain, *token_ids[start : start + BLOCK_TOKENS]))
        hashes.append(chain)
    return hashes
