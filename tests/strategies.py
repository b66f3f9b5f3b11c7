"""Hypothesis strategies the services' property tests share: requests drawn mostly sane,
with a wild part now and then, so wild values reach the engine past validation."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st


def mostly(usual: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` seven times in eight, else `wild`: a wild value mostly meets an otherwise
    valid request, and so gets past validation into the engine."""
    return st.integers(0, 7).flatmap(lambda roll: wild if roll == 0 else usual)


def wild_strings(
    words: Iterable[str], lengths: Iterable[int], short: st.SearchStrategy | None = None
) -> st.SearchStrategy:
    """Short random text (or `short`), words that mean something to the service, and one
    character (of any width in UTF-8) repeated to each of `lengths`."""
    return st.one_of(
        st.text(max_size=24) if short is None else short,
        st.sampled_from(list(words)),
        st.tuples(st.characters(codec="utf-8"), st.sampled_from(list(lengths))).map(
            lambda pair: pair[0] * pair[1]
        ),
    )
