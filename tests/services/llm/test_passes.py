"""Prefill's fixed cuts (services/llm/passes.py): every prompt, cached in part or not, is
computed in the same passes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.llm.passes import cut_at_or_before, passes

pytestmark = pytest.mark.unit


@given(st.integers(0, 5000), st.integers(1, 5000))
def test_passes_from_any_cut_are_the_tail_of_the_passes_from_zero(cached, length):
    """A prompt's passes after a hit are exactly the fresh run's passes past the hit: the
    same rows go through the same shapes."""
    start = min(cut_at_or_before(cached), length)
    start = cut_at_or_before(start)
    fresh = passes(0, length)
    assert passes(start, length) == [(s, e) for s, e in fresh if s >= start]
    assert [s for s, _ in fresh] == [0, *(e for _, e in fresh[:-1])]
    assert fresh[-1][1] == length
    assert all(0 < e - s <= 256 for s, e in fresh)


@given(st.integers(0, 5000))
def test_a_hit_is_used_up_to_the_last_cut_it_covers(tokens):
    cut = cut_at_or_before(tokens)
    assert cut <= tokens < cut + (64 if cut < 256 else 256)
    assert cut_at_or_before(cut) == cut


def test_a_pass_never_starts_between_cuts():
    with pytest.raises(ValueError, match="starts at a cut"):
        passes(70, 100)
