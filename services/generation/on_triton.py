"""Generation on Triton Inference Server: the prompt's ids to a decoupled model over
ModelStreamInfer, its tokens back through the tokenizer service's detokenizer as they
arrive: the shape of Triton's vLLM and TensorRT-LLM backends.

The model (k8s/triton-model-repository/text_generation) samples, stops at the end token
or the length, and checks for cancellation before every step, so when the client goes
away, its deadline passes or a stop sequence appears, the stream this task holds is
cancelled and Triton stops generating within a token. Stop sequences are matched here,
exactly as the decode workers match them. Guided choices need the model's logits at each
step, which Triton does not return: they are refused with a field violation, never
silently ignored.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np

from aimesh.llm.v1 import sampling_pb2
from mesh.triton import TritonModel
from mesh.validation import Violations
from services.generation.pipeline import Delta, Outcome
from services.generation.text import TokenizerClient
from services.llm.requests import stopping as stopping_limits
from services.llm.settings import LlmSettings
from services.llm.stopping import StopChecker

OUTPUTS = ("output_ids", "finish_reason")
_FINISH = {
    b"length": sampling_pb2.FINISH_REASON_LENGTH,
    b"eos": sampling_pb2.FINISH_REASON_EOS,
}


class TritonGeneration:
    def __init__(
        self, model: TritonModel, tokenizer: TokenizerClient, settings: LlmSettings
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings

    def unsupported(
        self,
        sampling: sampling_pb2.SamplingParameters,
        stopping: sampling_pb2.StoppingCriteria,
        violations: Violations,
    ) -> None:
        reason = f"is not supported by the Triton model {self.model.settings.model!r}"
        violations.check(not sampling.choices, "sampling.choices", reason)

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: sampling_pb2.SamplingParameters,
        stopping: sampling_pb2.StoppingCriteria,
    ) -> AsyncIterator[Delta | Outcome]:
        # Validated by the router already: this only resolves the defaults.
        limits = stopping_limits(stopping, len(prompt_ids), self.settings, Violations())
        inputs = {
            "input_ids": np.array(prompt_ids, dtype=np.int64),
            "max_new_tokens": np.array([limits.max_new_tokens], dtype=np.int32),
            "temperature": np.array([sampling.temperature], dtype=np.float32),
            "top_k": np.array([sampling.top_k], dtype=np.int32),
            "top_p": np.array([sampling.top_p if sampling.HasField("top_p") else 1.0], np.float32),
            "seed": np.array([sampling.seed], dtype=np.uint64),
            "repetition_penalty": np.array([sampling.repetition_penalty or 1.0], np.float32),
            "frequency_penalty": np.array([sampling.frequency_penalty], np.float32),
            "ignore_eos": np.array([limits.ignore_eos]),
        }
        started = time.perf_counter()
        first_at: float | None = None
        finish = sampling_pb2.FINISH_REASON_UNSPECIFIED
        detokenize_s = 0.0
        holdback = Holdback(limits.stop_sequences)
        detokenizer = self.tokenizer.detokenizer()
        finished = False
        try:
            await detokenizer.open(request_id)
            # Leaving this block before the final response (a stop sequence, or the caller
            # gone) closes the stream, which cancels the request on Triton.
            async with aclosing(
                self.model.stream(inputs, OUTPUTS, "finish_reason", request_id=request_id)
            ) as responses:
                async for response in responses:
                    for token in response["output_ids"].tolist():
                        first_at = first_at or time.perf_counter()
                        pushed = time.perf_counter()
                        piece = await detokenizer.push([token])
                        detokenize_s += time.perf_counter() - pushed
                        ids, text = holdback.feed(token, piece)
                        if ids:
                            yield Delta(text, ids)
                        if holdback.stopped:
                            break
                    if holdback.stopped:
                        finish = sampling_pb2.FINISH_REASON_STOP_SEQUENCE
                        break
                    if response["finish_reason"] is not None:
                        finish = _FINISH[response["finish_reason"][0]]
            if not holdback.stopped:
                ids, text = holdback.rest()
                if ids:
                    yield Delta(text, ids)
                async for tail in detokenizer.finish():
                    yield Delta(tail, [])
                finished = True
        finally:
            if not finished:
                detokenizer.cancel()
        ended = time.perf_counter()
        first_at = first_at or ended
        yield Outcome(
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            completion_tokens=holdback.generated,
            prefill_worker="",
            decode_worker=self.model.settings.url,
            stages={
                "prefill": first_at - started,
                "decode": ended - first_at,
                "detokenize": detokenize_s,
            },
        )


class Holdback:
    """Stop sequences on the router's side of Triton's stream, with the decode workers'
    own StopChecker fed each token's text from the detokenizer: text that could still
    become a stop sequence is held back, and one that appears is never shown. It only
    matches text; Triton itself stops at the end token and at the length."""

    def __init__(self, stop_sequences: tuple[str, ...]) -> None:
        self._piece = ""
        self._held: deque[tuple[int, str]] = deque()
        self._checker = StopChecker(
            max_new_tokens=2**31 - 1,
            eos_ids=frozenset(),
            stop_sequences=stop_sequences,
            token_text=lambda _: self._piece,
        )

    @property
    def stopped(self) -> bool:
        return self._checker.finish is not None

    @property
    def generated(self) -> int:
        return self._checker.generated

    def feed(self, token: int, piece: str) -> tuple[list[int], str]:
        """The tokens now safe to show, with their text."""
        self._piece = piece
        self._held.append((token, piece))
        released = self._checker.feed(token)
        if self.stopped:
            self._held.clear()
            return [], ""
        return self._take(len(released))

    def rest(self) -> tuple[list[int], str]:
        """What was held when the stream ended without a stop sequence."""
        return self._take(len(self._held))

    def _take(self, count: int) -> tuple[list[int], str]:
        taken = [self._held.popleft() for _ in range(count)]
        return [token for token, _ in taken], "".join(piece for _, piece in taken)
