"""One generation, hop by hop: tokenize -> prefill -> decode (which pulls the KV) ->
detokenize, with text deltas streamed back as decode produces tokens.

Every call runs in the caller's task, so the caller's deadline and cancellation reach
each hop. The KV a prefill worker leased is released here if the request ends before
decode took it over (decode releases it once pulled); the lease covers a router crash.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from mesh.client import ChannelPool
from mesh.validation import Violations
from services.generation.text import TokenizerClient
from services.generation.workers import DecodePicker, PrefillPicker
from services.llm.kv_transfer import KvReleaser, new_handle_id

PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]
DECODE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Outcome:
    finish_reason: int
    prompt_tokens: int
    completion_tokens: int
    prefill_worker: str
    decode_worker: str
    stages: dict[str, float] = field(default_factory=dict)


def _stage_seconds(timing: common_pb2.Timing, name: str) -> float:
    return sum(s.duration_ns for s in timing.stages if s.name == name) / 1e9


class Pipeline:
    """Generation on aimesh's own prefill and decode workers."""

    def __init__(
        self,
        channels: ChannelPool,
        tokenizer: TokenizerClient,
        prefill: PrefillPicker,
        decode: DecodePicker,
    ) -> None:
        self.channels = channels
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.decode = decode
        self.releaser = KvReleaser(channels)

    def unsupported(
        self,
        sampling: sampling_pb2.SamplingParameters,
        stopping: sampling_pb2.StoppingCriteria,
        violations: Violations,
    ) -> None:
        """Every option of the API runs here."""

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: sampling_pb2.SamplingParameters,
        stopping: sampling_pb2.StoppingCriteria,
    ) -> AsyncIterator[Delta | Outcome]:
        prefill_target = self.prefill.pick()
        # Chosen here so the KV can be released even if this call is cancelled while
        # prefill's answer is on its way (prefill drops a KV released before it exists).
        handle_id = new_handle_id()
        try:
            prefill = await prefill_pb2_grpc.PrefillServiceStub(
                self.channels.get(prefill_target, PREFILL)
            ).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=request_id,
                    token_ids=prompt_ids,
                    sampling=sampling,
                    handle_id=handle_id,
                )
            )
        except BaseException:
            self.releaser.release_later(prefill_target, handle_id)
            raise
        handle = prefill.kv_handle
        decode_request = decode_pb2.DecodeRequest(
            request_id=request_id,
            kv_handle=handle,
            prompt_token_ids=prompt_ids,
            first_token_id=prefill.first_token_id,
            first_token_logprob=prefill.first_token_logprob,
            sampling=sampling,
            stopping=stopping,
        )
        detokenize_s = 0.0
        complete: decode_pb2.DecodeComplete | None = None
        detokenizer = self.tokenizer.detokenizer()
        try:
            # Opened here: a cancel while it opens still releases the leased KV below.
            await detokenizer.open(request_id)
            decode_target = ""
            async for message, target in self._decode(decode_request):
                decode_target = target
                if message.HasField("complete"):
                    complete = message.complete
                    continue
                ids = list(message.chunk.token_ids)
                started = time.perf_counter()
                text = await detokenizer.push(ids)
                detokenize_s += time.perf_counter() - started
                yield Delta(text, ids)
            async for tail in detokenizer.finish():
                yield Delta(tail, [])
        finally:
            if complete is None:
                self.releaser.release_later(handle.address, handle.id)
                detokenizer.cancel()
        if complete is None:
            raise RuntimeError("decode stream ended without its complete message")
        yield Outcome(
            finish_reason=complete.finish_reason,
            prompt_tokens=len(prompt_ids),
            completion_tokens=complete.generated_tokens,
            prefill_worker=prefill_target,
            decode_worker=decode_target,
            stages={
                "queue": _stage_seconds(prefill.timing, "queue")
                + _stage_seconds(complete.timing, "queue"),
                "prefill": _stage_seconds(prefill.timing, "prefill"),
                "kv_transfer": _stage_seconds(complete.timing, "kv_transfer"),
                "decode": _stage_seconds(complete.timing, "decode"),
                "detokenize": detokenize_s,
            },
        )

    async def _decode(
        self, request: decode_pb2.DecodeRequest
    ) -> AsyncIterator[tuple[decode_pb2.DecodeResponse, str]]:
        """Decode on the least-loaded worker; a worker that cannot be reached at all is
        swapped for another before anything streamed (the KV is still leased)."""
        tried: frozenset[str] = frozenset()
        while True:
            target = self.decode.pick(exclude=tried)
            call = decode_pb2_grpc.DecodeServiceStub(self.channels.get(target, DECODE)).Decode(
                request
            )
            streamed = False
            try:
                async for message in call:
                    streamed = True
                    yield message, target
                return
            except grpc.aio.AioRpcError as error:
                retry = not streamed and error.code() == grpc.StatusCode.UNAVAILABLE
                if not retry or len(tried) + 1 >= len(self.decode.workers):
                    raise
                self.decode.report_failure(target)
                tried = tried | {target}
