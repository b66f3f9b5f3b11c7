"""The LLM request messages (sampling, stopping), validated once by the router, and the
checks prefill and decode keep to protect their engines.

The router applies every rule of the API and resolves the defaults (stopping()); what it
sends on is the validated form, which prefill and decode only convert. sampling_params()
is also their guard: its ranges are what the sampler needs to stay finite, and a token id
outside the vocabulary would index past the logits. decode_length() is decode's guard on
the length the router resolved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aimesh.llm.v1 import sampling_pb2
from mesh.validation import Violations
from services.llm.llama import LlamaConfig
from services.llm.sampling import SamplingParams
from services.llm.settings import LlmSettings

# A seen token's logit is divided (or multiplied) by the penalty: far below this, a logit
# overflows float32 to inf and the step's softmax turns to NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_STOP_SEQUENCES = 4
# OpenAI's bound on top_logprobs; each costs a top-k over the vocabulary per token.
MAX_TOP_LOGPROBS = 20
MAX_STOP_BYTES = 64
# OpenAI's bound on n (choices of one prompt); each is a decode sequence.
MAX_N = 16
SEED_SPACE = 2**64


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (SamplingParameters.n):
    seeded choices differ, and each reproduces alone with its own seed."""
    return (seed + index) % SEED_SPACE


def for_choice(
    sampling: sampling_pb2.SamplingParameters, index: int
) -> sampling_pb2.SamplingParameters:
    """Choice `index`'s own sampling, as its decode (or a Triton request) takes it: its
    seed, and n left out."""
    own = sampling_pb2.SamplingParameters()
    own.CopyFrom(sampling)
    own.ClearField("n")
    if sampling.HasField("seed") or index:  # an unset seed samples as 0
        own.seed = choice_seed(sampling.seed, index)
    return own


def sampling_params(
    message: sampling_pb2.SamplingParameters,
    vocab_size: int,
    violations: Violations,
    end_token: int | None = None,
) -> SamplingParams:
    """The ranges the sampler needs. `end_token` (the model's end-of-sequence id) closes
    every guided choice, so the output stops right after one; only prefill and decode,
    which know it, pass it."""
    violations.in_range(message.temperature, "sampling.temperature", 0.0, 2.0)
    violations.in_range(message.top_k, "sampling.top_k", 0, vocab_size)
    top_p = 1.0
    if message.HasField("top_p"):
        top_p = message.top_p
        violations.check(
            math.isfinite(top_p) and 0.0 < top_p <= 1.0,
            "sampling.top_p",
            f"must be in (0, 1], got {top_p}",
        )
    penalty = message.repetition_penalty or 1.0
    violations.check(
        math.isfinite(penalty) and MIN_REPETITION_PENALTY <= penalty <= 10.0,
        "sampling.repetition_penalty",
        f"must be in [{MIN_REPETITION_PENALTY}, 10] (0 = off), got {message.repetition_penalty}",
    )
    violations.in_range(message.frequency_penalty, "sampling.frequency_penalty", -2.0, 2.0)
    choices = tuple(tuple(c.ids) for c in message.choice_token_ids)
    violations.check(
        all(c and all(i < vocab_size for i in c) for c in choices),
        "sampling.choice_token_ids",
        "every choice must be a non-empty sequence of token ids in the vocabulary",
    )
    violations.check(
        not (message.HasField("constraint") and (message.choices or choices)),
        "sampling.constraint",
        "cannot be combined with sampling.choices",
    )
    violations.in_range(message.top_logprobs, "sampling.top_logprobs", 0, MAX_TOP_LOGPROBS)
    violations.in_range(message.n, "sampling.n", 0, MAX_N)
    violations.check(
        message.logprobs or not message.top_logprobs,
        "sampling.top_logprobs",
        "needs sampling.logprobs",
    )
    if end_token is not None:
        choices = tuple((*choice, end_token) for choice in choices)
    return SamplingParams(
        choices=choices,
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=top_p,
        seed=message.seed if message.HasField("seed") else None,
        repetition_penalty=penalty,
        frequency_penalty=message.frequency_penalty,
        top_logprobs=message.top_logprobs if message.logprobs else 0,
    )


def top_logprobs(top: tuple[tuple[int, float], ...]) -> sampling_pb2.TopLogprobs:
    """A Draw's most likely tokens as prefill and decode send them."""
    return sampling_pb2.TopLogprobs(
        token_ids=[token for token, _ in top], logprobs=[logprob for _, logprob in top]
    )


def end_token(config: LlamaConfig) -> int | None:
    """The id that ends a guided choice: the model's first end-of-sequence token."""
    return config.eos_token_ids[0] if config.eos_token_ids else None


@dataclass(frozen=True)
class Stopping:
    max_new_tokens: int
    stop_sequences: tuple[str, ...]
    ignore_eos: bool


def stopping(
    message: sampling_pb2.StoppingCriteria,
    prompt_tokens: int,
    settings: LlmSettings,
    violations: Violations,
) -> Stopping:
    """The router's rules for stopping, with the defaults resolved."""
    max_new = settings.default_max_new_tokens
    room = settings.max_seq_len - prompt_tokens
    if message.HasField("max_new_tokens"):
        max_new = message.max_new_tokens
        field = "stopping.max_new_tokens"
        if violations.in_range(max_new, field, 1, settings.max_new_tokens_limit):
            violations.check(
                max_new <= room,
                field,
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new}) exceeds the "
                f"context window of {settings.max_seq_len} tokens",
            )
    violations.check(
        len(message.stop_sequences) <= MAX_STOP_SEQUENCES,
        "stopping.stop_sequences",
        f"at most {MAX_STOP_SEQUENCES}, got {len(message.stop_sequences)}",
    )
    for i, stop in enumerate(message.stop_sequences):
        violations.check(
            0 < len(stop.encode()) <= MAX_STOP_BYTES,
            f"stopping.stop_sequences[{i}]",
            f"must be 1 to {MAX_STOP_BYTES} bytes",
        )
    return Stopping(
        # An unset length is capped by the room left in the context window.
        max_new_tokens=max(1, min(max_new, room)),
        stop_sequences=tuple(message.stop_sequences),
        ignore_eos=message.ignore_eos,
    )


def decode_length(
    max_new_tokens: int, prompt_tokens: int, max_seq_len: int, violations: Violations
) -> None:
    """The length the router resolved must fit what is left of decode's context."""
    room = max_seq_len - prompt_tokens
    violations.check(
        1 <= max_new_tokens <= room,
        "max_new_tokens",
        f"must be 1 to {room} for a {prompt_tokens}-token prompt, got {max_new_tokens}",
    )


def check_prompt(
    token_ids: list[int], vocab_size: int, settings: LlmSettings, violations: Violations, field: str
) -> None:
    """A prompt must be non-empty, leave room for one generated token, and use known ids."""
    if not violations.check(len(token_ids) > 0, field, "must not be empty"):
        return
    violations.check(
        len(token_ids) < settings.max_seq_len,
        field,
        f"{len(token_ids)} tokens leave no room in the {settings.max_seq_len}-token context",
    )
    bad = next((i for i, t in enumerate(token_ids) if t >= vocab_size), None)
    if bad is not None:
        violations.add(f"{field}[{bad}]", f"token id {token_ids[bad]} >= vocabulary {vocab_size}")
