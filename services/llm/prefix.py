"""Prompt prefixes as chains of block hashes, the key both prefill's prefix cache and the
router's prefix-aware pick use (vLLM's and SGLang's idea: a block's hash covers every
token before it, so equal hashes at block i mean equal prompts up to block i's end).

Python's hash of a tuple of ints is not salted per process, so the chain is the same in
every process of one Python version; nothing needs it to be more than that, since each
process keeps its own table.
"""

from __future__ import annotations

# Tokens per block: small enough that a shared system prompt loses at most 15 tokens to
# the block edge, large enough that a 2,048-token prompt is 128 hashes.
BLOCK_TOKENS = 16


def block_hashes(token_ids: list[int], limit: int | None = None) -> list[int]:
    """The chain hash at the end of each whole block of `token_ids` (at most `limit`)."""
    whole = len(token_ids) // BLOCK_TOKENS
    if limit is not None:
        whole = min(whole, limit)
    hashes: list[int] = []
    chain = 0
    for block in range(whole):
        start = block * BLOCK_TOKENS
        chain = hash((chain, *token_ids[start : start + BLOCK_TOKENS]))
        hashes.append(chain)
    return hashes
