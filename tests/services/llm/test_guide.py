"""Constrained decoding (services/llm/guide.py) on the embedded model's vocabulary: every
schema either compiles and then only ever yields output valid against it, or is refused
at validation naming the field. The model's own outputs under constraints, in a running
batch: test_constrained_mesh.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aimesh.llm.v1 import sampling_pb2
from mesh.failures import InvalidInput
from mesh.validation import Violations
from services.llm.artifacts import load_tokenizer
from services.llm.guide import Guide, GuideError, Vocabularies, Vocabulary, grammar_of
from services.llm.sampling import SamplingParams, sample

pytestmark = pytest.mark.unit

Constraint = sampling_pb2.OutputConstraint
# Every schema the strategy draws describes outputs of bounded length (strings, integers
# and arrays are bounded), so a walk of random tokens ends within this many.
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def vocabulary(model_dir: Path) -> Vocabulary:
    config = json.loads((model_dir / "config.json").read_text())
    return Vocabulary(model_dir / "tokenizer.json", config["vocab_size"], [config["eos_token_id"]])


@pytest.fixture(scope="module")
def text_of(model_dir: Path):
    tokenizer = load_tokenizer(model_dir)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def guide_for(vocabulary: Vocabulary, constraint: Constraint) -> Guide:
    violations = Violations()
    grammar = grammar_of(constraint, violations)
    guide = vocabulary.guide(grammar, violations)
    violations.raise_if_any()
    assert guide is not None
    return guide


def walk(guide: Guide, vocabulary: Vocabulary, seed: int, eos: int) -> tuple[list[int], bool]:
    """Random logits, sampled under the guide's mask until the end-of-sequence token or
    MAX_TOKENS: the ids before the end, and whether it ended."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, seed=seed)
    ids: list[int] = []
    for index in range(MAX_TOKENS):
        logits = torch.randn(vocabulary.vocab_size, generator=generator)
        token = sample(logits, params, ids, index, allowed=guide.allowed()).token
        if token == eos:
            return ids, True
        guide.advance(token)
        ids.append(token)
    return ids, False


# Any assigned character. Unassigned ones are left out: llguidance 1.9.1 masks U+40000
# (F1 80 80 80) wrongly, and its sequence then fails with INVALID_ARGUMENT mid-stream.
TEXT = st.characters(exclude_categories=("Cs", "Cn", "Co"))
NAMES = st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-1000, 1000).flatmap(
        lambda low: st.integers(low, low + 5000).map(
            lambda high: {"type": "integer", "minimum": low, "maximum": high}
        )
    ),
    st.integers(0, 12).map(lambda most: {"type": "string", "maxLength": most}),
    st.lists(st.text(TEXT, min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.from_regex(r"[a-z]{1,6}", fullmatch=True).map(lambda value: {"const": value}),
)


def _object(properties: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


SCHEMAS = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
            lambda properties: st.lists(
                st.sampled_from(sorted(properties)), unique=True, max_size=len(properties)
            ).map(lambda required: _object(properties, required))
        ),
        st.builds(
            lambda items, most: {"type": "array", "items": items, "maxItems": most},
            children,
            st.integers(0, 3),
        ),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_a_constrained_output_is_always_valid_against_its_schema(
    vocabulary, text_of, model_dir, schema, seed
):
    """Hypothesis draws the schema; random logits stand in for any model. The output
    parses and validates whenever the mask lets the sequence end, and it always ends
    (the schemas bound every length)."""
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    guide = guide_for(vocabulary, Constraint(json_schema=json.dumps(schema)))
    ids, ended = walk(guide, vocabulary, seed, eos)
    assert ended, f"no end after {MAX_TOKENS} tokens: {text_of(ids)!r}"
    jsonschema.validate(json.loads(text_of(ids)), schema)


@pytest.mark.parametrize("seed", range(3))
def test_json_object_and_regex_outputs_are_what_they_promise(vocabulary, text_of, model_dir, seed):
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    pattern = r"[0-9]{3}-[A-Z]{2,4}"
    ids, ended = walk(guide_for(vocabulary, Constraint(regex=pattern)), vocabulary, seed, eos)
    assert ended and re.fullmatch(pattern, text_of(ids))
    # Any JSON object may nest without bound: a walk that ends is an object.
    ids, ended = walk(guide_for(vocabulary, Constraint(json_object=True)), vocabulary, seed, eos)
    if ended:
        assert isinstance(json.loads(text_of(ids)), dict)


def test_the_mask_allows_exactly_what_can_continue(vocabulary, model_dir):
    """A token that cannot continue the output is masked, the end token only once the
    output is complete, and a token fed past the mask is the request's error."""
    tokenizer = load_tokenizer(model_dir)
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    guide = guide_for(vocabulary, Constraint(json_schema=json.dumps(schema)))
    # The output must open with `{"`: llguidance allows the one token that spells it.
    opening, letter = tokenizer.token_to_id('{"'), tokenizer.token_to_id("a")
    allowed = guide.allowed()
    assert allowed[opening] and not allowed[letter] and not allowed[eos]
    for token in tokenizer.encode('{"n": 42}', add_special_tokens=False).ids:
        assert guide.allowed()[token]
        guide.advance(token)
    allowed = guide.allowed()
    assert allowed[eos] and int(allowed.sum()) == 1
    with pytest.raises(GuideError) as refused:
        guide.advance(letter)
    assert refused.value.violations[0].field == "sampling.constraint"


def test_a_vocabulary_is_built_once_on_first_use(model_dir):
    built = []

    def directory() -> Path:
        built.append(1)
        return model_dir

    config = json.loads((model_dir / "config.json").read_text())
    vocabularies = Vocabularies(directory, config["vocab_size"], [config["eos_token_id"]])
    assert vocabularies.guide(Constraint()) is None and built == []
    first = vocabularies.guide(Constraint(regex="ab"))
    second = vocabularies.guide(Constraint(regex="ab"))
    assert first is not None and second is not None and first.matcher is not second.matcher
    assert built == [1]
    with pytest.raises(InvalidInput) as refused:
        vocabularies.guide(Constraint(regex="(("))
    assert refused.value.violations[0].field == "sampling.constraint.regex"
