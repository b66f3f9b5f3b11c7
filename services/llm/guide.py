"""Constrained decoding: an OutputConstraint becomes a mask over the vocabulary before
every token a constrained sequence samples.

llguidance (the engine llama.cpp uses for JSON schemas and vLLM and SGLang offer as a
backend) does the work: a constraint becomes a grammar text (its JSON Schema, regex and
Lark front ends), a matcher per sequence follows the tokens sampled so far and computes
the next mask, in Rust, with the GIL released. Measured against xgrammar on this model's
vocabulary (docs/benchmarks.md, "Constrained decoding"): both were 100% valid on the same
schemas and cover the same JSON Schema features; xgrammar fills a mask about twice as
fast (7-14 µs against 25-33 µs median), both far below a forward pass. llguidance wins on
what the mesh needs: no dependency (xgrammar pulls triton, ~1 GB, into a CPU install),
errors as plain messages a 400 can quote (xgrammar raises C++ traces), the JSON Schema
spec's default for `additionalProperties` (xgrammar's strict mode refuses extra keys),
and logits past the tokenizer's last id masked (xgrammar leaves them open).

One Vocabulary per process (the model's tokenizer.json as llguidance reads it, built on
the first constrained request), one Guide per sequence. A constraint's grammar text, and
the matcher built from it against the vocabulary, are cached: a client sends the same
schema with every request, and each new sequence starts from a copy.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance
import numpy as np
import torch

from aimesh.llm.v1 import sampling_pb2
from mesh.failures import Conflict, FieldViolation, InvalidInput
from mesh.validation import Violations

MAX_SCHEMA_BYTES = 64 * 1024
MAX_REGEX_BYTES = 4 * 1024
MAX_GRAMMAR_BYTES = 64 * 1024
FIELD = "sampling.constraint"
# JSON output the way OpenAI's structured outputs and json.dumps write it: a single space
# after ':' and ',', no newlines (llguidance's default would allow any whitespace, which a
# small model fills with newlines until max_tokens).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on one constraint's work, so that a hostile one costs its own request an error,
# not every neighbour in the batch a stalled step. With llguidance's defaults a regex
# such as (a{1000}){1000} took 2 s in one mask here, and a string pattern of a{100000}
# 50 ms a step; with these, ~50-80 ms once and then the request's error, while ordinary
# schemas (tests/services/llm/test_guide.py) never meet them. A lexer keeps at most
# 20,000 states (~1-2 kB each; the default allows 250,000).
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=100_000,
    step_lexer_fuel=50_000,
    max_lexer_states=20_000,
    verbose_errors=False,
)
_LIMITS = {
    "json_schema": MAX_SCHEMA_BYTES,
    "regex": MAX_REGEX_BYTES,
    "lark_grammar": MAX_GRAMMAR_BYTES,
}


def _grammar(kind: str, source: str) -> str:
    """The llguidance grammar text of one constraint; ValueError when a JSON schema is not
    a JSON object."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_FORMAT
        )
    if kind == "json_schema":
        schema = json.loads(source)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    return llguidance.LLMatcher.grammar_from_lark(source)


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, source: str) -> tuple[str, str]:
    """(grammar text, "") or ("", the compiler's error), cached: a client sends the same
    schema with every request."""
    try:
        grammar = _grammar(kind, source)
    except ValueError as error:  # json.JSONDecodeError included
        return "", str(error)
    except RecursionError:  # Python's JSON parser stops near 1,000 levels
        return "", "nests too deep"
    return grammar, llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)


def grammar_of(constraint: sampling_pb2.OutputConstraint, violations: Violations) -> str:
    """The grammar text of a constraint ("" when there is none); a constraint too large or
    one that does not compile is a violation of `sampling.constraint.<kind>` quoting the
    compiler. Validating a large schema takes milliseconds: callers on an event loop run
    this in a thread."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return ""
    field = f"{FIELD}.{kind}"
    source = "" if kind == "json_object" else getattr(constraint, kind)
    if kind == "json_object":
        if not violations.check(constraint.json_object, field, "must be true when set"):
            return ""
    else:
        size = len(source.encode())
        if not violations.check(
            0 < size <= _LIMITS[kind], field, f"must be 1 to {_LIMITS[kind]} bytes, got {size}"
        ):
            return ""
    grammar, error = _compiled(kind, source)
    violations.check(not error, field, f"does not compile: {error}")
    return grammar if not error else ""


class GuideError(InvalidInput):
    """A matcher that cannot go on: a grammar error found only as the output grew
    (llguidance's resource limits), or a token outside the grammar. The request's
    constraint is what cannot be followed, so it is the request's error."""

    def __init__(self, problem: str) -> None:
        super().__init__([FieldViolation(FIELD, problem)])


class Guide:
    """One sequence's matcher: which tokens may come next, and the tokens that came."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """A bool tensor over the vocabulary: True where a token may come next (the
        end-of-sequence tokens once the output is complete). llguidance drops the GIL
        while it computes, so this can run beside a forward pass."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_error() or not allowed.any():
            raise GuideError(self.matcher.get_error() or "no token can continue the output")
        return torch.from_numpy(allowed)

    def advance(self, token: int) -> None:
        """Takes the token sampled under the last mask (or, in decode, prefill's first)."""
        if not self.matcher.consume_token(token):
            raise GuideError(f"token {token} breaks the constraint: {self.matcher.get_error()}")


class Vocabulary:
    """The model's tokens as llguidance reads them (from tokenizer.json), with the
    model's end-of-sequence ids: what every Guide of this process masks."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        # n_vocab is the logits' width: a model may pad its output layer past the
        # tokenizer's last id, and those ids are never allowed.
        self.tokenizer = llguidance.LLTokenizer(
            str(tokenizer_json), n_vocab=vocab_size, eos_token=list(eos_ids)
        )
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._matchers = functools.lru_cache(maxsize=64)(self._matcher)
        self._lock = threading.Lock()  # servicer threads start guides concurrently

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)

    def guide(self, grammar: str, violations: Violations) -> Guide | None:
        """A matcher at the start of a grammar from grammar_of (each grammar is built
        against the vocabulary once, then copied); a violation of `sampling.constraint`
        when this vocabulary cannot express it."""
        # Built outside the lock (a complex grammar takes long, and other requests' copies
        # must not wait for it; a concurrent miss builds it twice); copied under it.
        pristine = self._matchers(grammar)
        if not violations.check(not pristine.is_error(), FIELD, pristine.get_error()):
            return None
        with self._lock:
            return Guide(pristine.deep_copy(), self.vocab_size)


class Vocabularies:
    """A process's Vocabulary, built on first use: finding the tokenizer (for a GGUF, the
    one converted from its metadata) and reading ~50k tokens take time an unconstrained
    worker need not pay at start."""

    def __init__(
        self, tokenizer_dir: Callable[[], Path], vocab_size: int, eos_ids: Sequence[int]
    ) -> None:
        self._tokenizer_dir = tokenizer_dir
        self._sizes = (vocab_size, tuple(eos_ids))
        self._vocabulary: Vocabulary | None = None
        self._lock = threading.Lock()

    def get(self) -> Vocabulary:
        """Blocking the first time: call it off the event loop."""
        with self._lock:
            if self._vocabulary is None:
                path = self._tokenizer_dir() / "tokenizer.json"
                try:
                    self._vocabulary = Vocabulary(path, *self._sizes)
                except ValueError as error:  # e.g. more tokens than the model's logits
                    raise Conflict(f"constrained decoding is unavailable here: {error}") from None
            return self._vocabulary

    def guide(
        self, constraint: sampling_pb2.OutputConstraint, after: Sequence[int] = ()
    ) -> Guide | None:
        """The matcher a constrained request starts from (None when it has no constraint),
        past the tokens `after` (decode's first token, which prefill sampled); InvalidInput
        naming the constraint when it does not compile. Blocking: call it off the event
        loop."""
        violations = Violations()
        grammar = grammar_of(constraint, violations)
        violations.raise_if_any()
        if not grammar:
            return None
        guide = self.get().guide(grammar, violations)
        violations.raise_if_any()
        assert guide is not None
        for token in after:
            guide.advance(token)
        return guide
