"""One generation on aimesh's own workers, hop by hop: prefill -> decode (which pulls the
KV), with decode's token ids streamed back as they come. Text is the router's. The
choices of one prompt (SamplingParameters.n) share its one prefill: each decodes from its
own handle to the prompt's KV, on whichever decode worker is least loaded.

Every call runs in the caller's task, so the caller's deadline and cancellation reach
each hop; closing the stream early (a stop sequence, the caller gone) cancels the decode
call, and decode frees the sequence's slot at its next step. The KV a prefill worker
leased is released here if the request ends before decode took it over (decode releases
it once pulled); the lease covers a router crash.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from mesh import caller
from mesh.client import ChannelPool
from mesh.validation import Violations
from services.generation.workers import DecodePicker, PrefillPicker
from services.llm.kv_transfer import KvReleaser, new_handle_id
from services.llm.prefix import cache_scope
from services.llm.requests import Stopping, for_choice

PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]
DECODE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]
# Ends of a prefill call after which its prompt may have been computed all the same.
_MAY_HAVE_RUN = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass
class Outcome:
    """What an engine reports of one generation, filled in as it goes: a stream the router
    closes early (a stop sequence) keeps what was known by then."""

    finish_reason: int = sampling_pb2.FINISH_REASON_UNSPECIFIED
    # Every token the engine generated, a dropped end-of-sequence token included; 0 until
    # the engine says (the router then counts the tokens it received).
    generated_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    # Tokens a stage handled, where its service counted them (Stage.tokens).
    stage_tokens: dict[str, int] = field(default_factory=dict)
    # Prompt tokens whose KV came from prefill's prefix cache.
    cached_tokens: int = 0
    # The prompt went to the engine, which computed it or may have: its tokens are paid
    # for however the request ends.
    prompt_sent: bool = False


def _stage_seconds(timing: common_pb2.Timing, name: str) -> float:
    return sum(s.duration_ns for s in timing.stages if s.name == name) / 1e9


def _prompt_sent(outcomes: list[Outcome], sent: bool) -> None:
    for outcome in outcomes:
        outcome.prompt_sent = sent


class Pipeline:
    """Generation on aimesh's own prefill and decode workers."""

    def __init__(self, channels: ChannelPool, prefill: PrefillPicker, decode: DecodePicker) -> None:
        self.channels = channels
        self.prefill = prefill
        self.decode = decode
        self.releaser = KvReleaser(channels)

    def unsupported(
        self, sampling: sampling_pb2.SamplingParameters, violations: Violations
    ) -> None:
        """Every option of the API runs here."""

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
        """The prompt prefilled once, in the caller's task; then a token stream per choice
        (sampling.n, one Outcome each), each decoding from its own handle to the one KV.
        Leaving the block closes every stream and releases each handle whose decode did
        not finish (decode releases the handle it pulled)."""
        prefill = await self._prefill(request_id, prompt_ids, sampling, outcomes, cache_salt)
        starts = [
            prefill_pb2.ChoiceStart(
                first_token_id=prefill.first_token_id,
                first_token_logprob=prefill.first_token_logprob,
                first_token_top_logprobs=prefill.first_token_top_logprobs,
                kv_handle=prefill.kv_handle,
            ),
            *prefill.other_choices,
        ]
        finished: set[int] = set()
        streams = [
            self._choice(
                index,
                decode_pb2.DecodeRequest(
                    request_id=request_id,
                    kv_handle=start.kv_handle,
                    prompt_token_ids=prompt_ids,
                    first_token_id=start.first_token_id,
                    first_token_logprob=start.first_token_logprob,
                    first_token_top_logprobs=start.first_token_top_logprobs,
                    sampling=for_choice(sampling, index),
                    max_new_tokens=limits.max_new_tokens,
                    ignore_eos=limits.ignore_eos,
                ),
                outcome,
                finished,
            )
            for index, (start, outcome) in enumerate(zip(starts, outcomes, strict=True))
        ]
        try:
            yield streams
        finally:
            for stream in streams:
                await stream.aclose()
            for index, start in enumerate(starts):
                if index not in finished:
                    self.releaser.release_later(start.kv_handle.address, start.kv_handle.id)

    async def _prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: sampling_pb2.SamplingParameters,
        outcomes: list[Outcome],
        cache_salt: str,
    ) -> prefill_pb2.PrefillResponse:
        """The prompt's KV and every choice's first token, from one prefill worker; what
        it reports is every choice's (each counts the prompt)."""
        scope = cache_scope(caller.current(), cache_salt)
        prefill_target = self.prefill.pick(prompt_ids, scope)
        for outcome in outcomes:
            outcome.prefill_worker = prefill_target
        # Prefill makes the handles' ids: cancelled while the answer is on its way, this
        # call never learns them, so it frees the KV by a token of its own (prefill drops
        # a KV released before it exists).
        release_token = new_handle_id()
        try:
            stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(prefill_target, PREFILL))
            request = prefill_pb2.PrefillRequest(
                request_id=request_id,
                token_ids=prompt_ids,
                sampling=sampling,
                release_token=release_token,
                cache_salt=cache_salt,
            )
            _prompt_sent(outcomes, True)
            prefill = await stub.Prefill(request)
        except BaseException as error:
            # A prefill that answered with a refusal or was never reached computed nothing;
            # one the caller left (or ran out of time) while it ran may have computed it all.
            if isinstance(error, grpc.aio.AioRpcError) and error.code() not in _MAY_HAVE_RUN:
                _prompt_sent(outcomes, False)
            self.releaser.release_later(prefill_target, release_token=release_token)
            raise
        finally:
            self.prefill.done(prefill_target)
        for outcome in outcomes:
            outcome.stages["queue"] = _stage_seconds(prefill.timing, "queue")
            for name in ("prefix_cache", "prefill"):
                outcome.stages[name] = _stage_seconds(prefill.timing, name)
                outcome.stage_tokens[name] = sum(
                    s.tokens for s in prefill.timing.stages if s.name == name
                )
            outcome.cached_tokens = prefill.cached_tokens
        return prefill

    async def _choice(
        self,
        index: int,
        request: decode_pb2.DecodeRequest,
        outcome: Outcome,
        finished: set[int],
    ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """One choice's tokens from decode; `finished` learns the choices whose decode
        ended whole (and so released its handle)."""
        complete: decode_pb2.DecodeComplete | None = None
        decode_started = time.perf_counter()
        try:
            async with aclosing(self._decode(request, outcome)) as messages:
                async for message in messages:
                    if message.HasField("complete"):
                        complete = message.complete
                        continue
                    yield message.chunk
        finally:
            if complete is None:
                outcome.stages["decode"] = time.perf_counter() - decode_started
        if complete is None:
            raise RuntimeError("decode stream ended without its complete message")
        finished.add(index)
        outcome.finish_reason = complete.finish_reason
        outcome.generated_tokens = complete.generated_tokens
        outcome.stages["queue"] += _stage_seconds(complete.timing, "queue")
        outcome.stages["kv_transfer"] = _stage_seconds(complete.timing, "kv_transfer")
        outcome.stages["decode"] = _stage_seconds(complete.timing, "decode")

    async def _decode(
        self, request: decode_pb2.DecodeRequest, outcome: Outcome
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Decode on the least-loaded worker; a worker that cannot be reached at all is
        swapped for another before anything streamed (the KV is still leased). Closing
        this stream cancels the call."""
        tried: frozenset[str] = frozenset()
        while True:
            target = self.decode.pick(exclude=tried)
            stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(target, DECODE))
            call = stub.Decode(request)
            outcome.decode_worker = target
            streamed = False
            try:
                async for message in call:
                    streamed = True
                    yield message
                return
            except grpc.aio.AioRpcError as error:
                retry = not streamed and error.code() == grpc.StatusCode.UNAVAILABLE
                if not retry or len(tried) + 1 >= len(self.decode.workers):
                    raise
                self.decode.report_failure(target)
                tried = tried | {target}
            finally:
                call.cancel()
