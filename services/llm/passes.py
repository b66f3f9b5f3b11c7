"""Where prefill cuts a prompt into forward passes: at fixed positions, so that a prompt's
KV and first token come out bit for bit the same whether part of it came from the prefix
cache or not.

A forward pass over rows [s, e) rounds differently with every s and e (the GEMM and
attention kernels block and reduce by the shape they are given), by ~1e-5 in float32.
That is enough: after a cache hit that reused all but the last token (one row, not the
whole prompt), llama.cpp's 4-bit decode, continuing from the KV, wrote different greedy
text for 3 of 5 prompts here, from the 13th or 22nd token on. With passes cut only at
these positions, and a hit used up to the last position it covers, every prompt runs
the same passes over the same inputs, cached or not. What it costs, measured against one
pass (docs/benchmarks.md, "Greedy reproducibility"): a few more passes for a long
prompt, and a hit that ends between two cuts reuses only up to the first.

Cuts every 64 tokens up to 256, then every 256: short prompts (a chat's preamble, n
choices of one question) still find most of themselves cached, long ones run in passes
long enough that their GEMMs stay efficient.
"""

from __future__ import annotations

_FINE, _FINE_UNTIL, _COARSE = 64, 256, 256


def _step(position: int) -> int:
    return _FINE if position < _FINE_UNTIL else _COARSE


def cut_at_or_before(position: int) -> int:
    """The last cut at or before `position`: how much of a cached prefix a prompt uses."""
    return position - position % _step(position)


def passes(start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) as the passes that compute it; `start` must be a cut."""
    if start != cut_at_or_before(start):
        raise ValueError(f"a pass starts at a cut, not at {start}")
    bounds = []
    while start < end:
        stop = min(start + _step(start), end)
        bounds.append((start, stop))
        start = stop
    return bounds
