"""The router's text: ids to text with the model's tokenizer.json (DecodeStream), cut
exactly at stop strings."""

from __future__ import annotations

import random

import pytest

from services.generation.text import TextStream
from services.llm.artifacts import load_tokenizer

pytestmark = pytest.mark.unit

SAMPLE = "Hello naïve café 日本語 🙂 end.\nDone: x = [1, 2]  # ok"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _stream(tokenizer, ids: list[int], stops: tuple[str, ...] = (), step: int = 1):
    """Every delta, the ids pushed in groups of `step`, then finish()'s."""
    text = TextStream(tokenizer, stops)
    deltas = [text.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, text.finish()], text.stopped


def test_a_multi_byte_character_split_across_tokens_comes_out_whole(tokenizer):
    ids = _ids(tokenizer, " 日本語")
    assert len(ids) > 3, "the tokenizer spreads these characters' bytes over several tokens"
    deltas, _ = _stream(tokenizer, ids)
    assert "".join(deltas) == " 日本語"
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_chunks_joined_equal_a_one_shot_decode(tokenizer, step):
    rng = random.Random(step)
    special = [tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")]
    for _ in range(20):
        # Random ids include lone UTF-8 continuation bytes, half characters at the end
        # and special tokens: whatever the ids, the text is the one-shot decode's.
        ids = [rng.choice([rng.randrange(49152), *special]) for _ in range(rng.randrange(1, 40))]
        ids += _ids(tokenizer, SAMPLE)[: rng.randrange(12)]
        deltas, _ = _stream(tokenizer, ids, step=step)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_stop_string_split_across_tokens_is_cut_exactly(tokenizer):
    ids = _ids(tokenizer, " Paris is the capital of France. It is")
    # "tal of" begins inside the token " capital" and ends inside " of".
    deltas, stopped = _stream(tokenizer, ids, ("tal of",))
    assert stopped
    assert "".join(deltas) == " Paris is the capi"


def test_only_text_that_could_begin_a_stop_string_is_held_back(tokenizer):
    text = TextStream(tokenizer, ("END",))
    assert text.push(_ids(tokenizer, "abc")) == "abc"
    assert text.push(_ids(tokenizer, " E")) == " "  # "E" may begin "END"
    assert text.push(_ids(tokenizer, "N")) == ""
    assert text.push(_ids(tokenizer, "x")) == "ENx"  # it did not
    assert text.push(_ids(tokenizer, " EN")) == " "
    assert text.finish() == "EN"  # nothing more comes: held text is the output's
    assert not text.stopped


@pytest.mark.parametrize(
    "stop, before",
    [
        ("語", " café 日本"),  # one character whose three bytes are three tokens
        ("本語", " café 日"),
        ("日本", " café "),  # begins inside " 日", a space and three byte tokens
        ("é 日", " caf"),
    ],
)
def test_a_stop_string_inside_a_multi_byte_character_sequence(tokenizer, stop, before):
    ids = _ids(tokenizer, " café 日本語 🙂 end")
    deltas, stopped = _stream(tokenizer, ids, (stop,))
    assert stopped
    assert "".join(deltas) == before
    assert all("\ufffd" not in delta for delta in deltas)


def test_the_earliest_stop_string_wins_and_nothing_follows_it(tokenizer):
    text = TextStream(tokenizer, ("of", "capital"))
    out = text.push(_ids(tokenizer, " the capital of France"))
    assert out == " the " and text.stopped
    assert text.push(_ids(tokenizer, " more")) == "" and text.finish() == ""
