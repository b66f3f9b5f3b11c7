"""Generation on Triton Inference Server: the prompt's ids to a decoupled model over
ModelStreamInfer, its token ids back as they arrive: the shape of Triton's vLLM and
TensorRT-LLM backends. Text is the router's, as it is for aimesh's own workers.

The model (k8s/triton-model-repository/text_generation) samples, stops at the end token
or the length, and checks for cancellation before every step, so when the client goes
away, its deadline passes or the router sees a stop sequence, the stream this generator
holds is closed, which cancels the request, and Triton stops generating within a token.
Guided choices, constraints and logprobs need the model's logits at each step, which
Triton does not return: they are refused with a field violation, never silently ignored.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import numpy as np

from aimesh.llm.v1 import decode_pb2, sampling_pb2
from mesh.triton import TritonModel
from mesh.validation import Violations
from services.generation.pipeline import Outcome
from services.llm.requests import Stopping, for_choice

OUTPUTS = ("output_ids", "finish_reason")
_FINISH = {b"length": sampling_pb2.FINISH_REASON_LENGTH, b"eos": sampling_pb2.FINISH_REASON_EOS}


class TritonGeneration:
    def __init__(self, model: TritonModel) -> None:
        self.model = model

    def unsupported(
        self, sampling: sampling_pb2.SamplingParameters, violations: Violations
    ) -> None:
        reason = f"is not supported by the Triton model {self.model.settings.model!r}"
        violations.check(not sampling.choices, "sampling.choices", reason)
        violations.check(not sampling.HasField("constraint"), "sampling.constraint", reason)
        violations.check(not sampling.logprobs, "sampling.logprobs", reason)

    @asynccontextmanager
    async def choices(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: sampling_pb2.SamplingParameters,
        limits: Stopping,
        outcomes: list[Outcome],
        *,
        cache_salt: str = "",
    ) -> AsyncIterator[list[AsyncIterator[decode_pb2.TokenChunk]]]:
        """As Engine.choices. The model runs one sequence a request, so each choice is
        a request of its own (its prompt computed again), seeded as the choice's decode
        would be; Triton's model keeps no prefix cache, so `cache_salt` scopes nothing."""
        streams = [
            self._run(request_id, prompt_ids, for_choice(sampling, index), limits, outcome)
            for index, outcome in enumerate(outcomes)
        ]
        try:
            yield streams
        finally:
            for stream in streams:
                await stream.aclose()

    async def _run(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: sampling_pb2.SamplingParameters,
        limits: Stopping,
        outcome: Outcome,
    ) -> AsyncIterator[decode_pb2.TokenChunk]:
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
        outcome.decode_worker = self.model.settings.url
        started = time.perf_counter()
        first_at: float | None = None
        outcome.prompt_sent = True
        try:
            # Leaving this block before the final response (a stop sequence, or the caller
            # gone) closes the stream, which cancels the request on Triton.
            async with aclosing(
                self.model.stream(inputs, OUTPUTS, "finish_reason", request_id=request_id)
            ) as responses:
                async for response in responses:
                    if response["finish_reason"] is not None:
                        outcome.finish_reason = _FINISH[response["finish_reason"][0]]
                    if ids := response["output_ids"].tolist():
                        first_at = first_at or time.perf_counter()
                        yield decode_pb2.TokenChunk(token_ids=ids)
        finally:
            ended = time.perf_counter()
            first_at = first_at or ended
            outcome.stages["prefill"] = first_at - started
            outcome.stages["decode"] = ended - first_at
