"""The engine alone: incremental detokenization and the roles the chat template accepts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer.engine import DEFAULT_ROLES, TokenizerEngine

pytestmark = pytest.mark.unit


def _check_in_chunks(engine: TokenizerEngine, ids: list[int], data: st.DataObject) -> None:
    """Feeds `ids` in random-size chunks (empty ones too) and compares with one decode."""
    sizes = data.draw(st.lists(st.integers(min_value=0, max_value=6), max_size=len(ids)))
    detokenizer = engine.incremental_detokenizer(skip_special_tokens=False)
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detokenizer.push(ids[start : start + size]))
        start += size
    deltas += [detokenizer.push(ids[start:]), detokenizer.finish()]
    whole = engine.detokenize(ids, skip_special_tokens=False)
    assert "".join(deltas) == whole
    if "\ufffd" not in whole:  # valid UTF-8: no delta may hold a broken character
        assert not any("\ufffd" in delta for delta in deltas)


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=120), data=st.data())
def test_deltas_of_a_text_add_up_to_its_decode(engine: TokenizerEngine, text, data):
    ids = engine.tokenize(text, add_special_tokens=False, return_details=False).ids
    _check_in_chunks(engine, ids, data)


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49_151), max_size=60), data=st.data())
def test_deltas_of_any_ids_add_up_to_their_decode(engine: TokenizerEngine, ids, data):
    """Ids a model samples need not form valid UTF-8; the deltas must still add up."""
    _check_in_chunks(engine, ids, data)


def test_a_broken_tail_is_flushed_as_a_replacement(engine: TokenizerEngine):
    ids = engine.tokenize("a🙂", add_special_tokens=False, return_details=False).ids
    detokenizer = engine.incremental_detokenizer(skip_special_tokens=False)
    assert detokenizer.push(ids[:-1]) == ""
    assert detokenizer.finish() == "a\ufffd"
    assert detokenizer.finish() == ""


def test_a_template_that_renders_any_role_accepts_the_usual_ones(engine: TokenizerEngine):
    assert engine.roles == DEFAULT_ROLES
