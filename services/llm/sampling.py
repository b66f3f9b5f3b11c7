"""Choosing the next token: greedy, or seeded sampling with the usual filters.

Seeds are per token: token k of a sequence is drawn with a generator seeded from
(seed, k). The draw then depends on nothing else (not on which worker ran it, not on
which sequences shared the batch), so a seeded request reproduces exactly even though its
first token is sampled in prefill and the rest in decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

_SEED_STRIDE = 1_000_003
_SEED_MOD = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    # Guided choice: token sequences (each ending in an end-of-sequence id) the output
    # must be one of. Empty = unconstrained.
    choices: tuple[tuple[int, ...], ...] = ()
    # How many of the most likely tokens to report beside each sampled one (0 to 20).
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _penalise(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    if not history or (params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0):
        return logits
    logits = logits.clone()
    ids = torch.tensor(history, dtype=torch.long)
    if params.repetition_penalty != 1.0:
        seen = torch.unique(ids)
        chosen = logits[seen]
        logits[seen] = torch.where(
            chosen > 0, chosen / params.repetition_penalty, chosen * params.repetition_penalty
        )
    if params.frequency_penalty != 0.0:
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts
    return logits


def _guide(logits: torch.Tensor, params: SamplingParams, history: list[int], index: int):
    """Only the tokens that continue a choice the output so far is a prefix of survive."""
    generated = tuple(history[len(history) - index :]) if index else ()
    allowed = {
        choice[index]
        for choice in params.choices
        if len(choice) > index and choice[:index] == generated
    }
    if not allowed:
        return logits
    mask = torch.full_like(logits, float("-inf"))
    keep = torch.tensor(sorted(allowed), dtype=torch.long)
    mask[keep] = 0.0
    return logits + mask


class Draw(NamedTuple):
    """A sampled token, its log-probability and, when asked for, the most likely tokens
    with theirs (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _top(logits: torch.Tensor, normaliser: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens that can still be drawn (a masked token cannot)."""
    if k <= 0:
        return ()
    values, ids = torch.topk(logits, min(k, logits.shape[-1]))
    logprobs = (values - normaliser).tolist()  # one conversion, not one per element
    return tuple(
        (token, logprob)
        for token, logprob in zip(ids.tolist(), logprobs, strict=True)
        if logprob != float("-inf")
    )


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    history: list[int],
    index: int,
    allowed: torch.Tensor | None = None,
) -> Draw:
    """The token at generation step `index` (0 = the first), its log-probability and the
    top alternatives params.top_logprobs asks for.

    `history` is what the penalties look at: the prompt and the tokens generated so far.
    `allowed` (a constraint's mask, services.llm.guide) leaves only its tokens possible.
    Log-probabilities are under the model's distribution after the penalties and the
    masks, before temperature, top-k and top-p (OpenAI's and vLLM's reading: what the
    model believed, whatever the sampler then drew).
    """
    logits = _penalise(logits.float(), history, params)
    if params.choices:
        logits = _guide(logits, params, history, index)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    normaliser = torch.logsumexp(logits, dim=-1)
    top = _top(logits, normaliser, params.top_logprobs)
    token = _draw(logits, params, index)
    return Draw(token, float(logits[token] - normaliser), top)


def _draw(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    # Shifted so the largest logit is 0 before dividing: every positive temperature,
    # subnormal ones included, then gives finite or -inf logits (a near-zero temperature
    # becomes greedy) instead of inf - inf = NaN in the softmax.
    logits = (logits - logits.max()) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        threshold = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        # Drop a token once the tokens before it already reach top_p; the first stays.
        drop = cumulative - torch.softmax(ordered, dim=-1) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    generator = torch.Generator().manual_seed(
        ((params.seed or 0) * _SEED_STRIDE + index) % _SEED_MOD
    )
    return _inverse_cdf(probabilities, generator)


def _inverse_cdf(probabilities: torch.Tensor, generator: torch.Generator) -> int:
    """One draw: the first token whose cumulative probability passes a uniform number.
    torch.multinomial draws a random number per token (1.2 ms over 49k tokens here, most
    of a sampled step's sampling); this draws one (0.1 ms). In float64, so that the sum
    keeps the tail's mass. A token whose probability is 0 (filtered, masked) adds
    nothing to the sum, so it is never the first to pass."""
    cdf = probabilities.double().cumsum(-1)
    target = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    token = int(torch.searchsorted(cdf, target, right=True))
    if token == cdf.shape[-1]:  # rounding put the target on the total: the last token drawn
        token = int(torch.nonzero(probabilities).max())
    return token
