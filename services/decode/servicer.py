"""The decode worker's gRPC surface: pull the KV a prefill worker leased, join the running
batch, stream tokens; and GetLoad for routers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import decode_pb2, decode_pb2_grpc, kv_cache_pb2, sampling_pb2
from mesh.failures import Conflict, FieldViolation, InvalidInput
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.decode.engine import BLOCK_TOKENS, DecodeEngine, Sequence
from services.decode.settings import DecodeOptions
from services.decode.sources import PrefillSources
from services.llm import kv_codec, kv_transfer
from services.llm.artifacts import model_directory
from services.llm.described import load_served
from services.llm.guide import Vocabularies
from services.llm.kv_transfer import HANDLE_ID, HANDLE_ID_RULE, KvReleaser
from services.llm.llama import Llama, LlamaConfig, TorchSlots
from services.llm.requests import (
    check_prompt,
    decode_length,
    end_token,
    sampling_params,
    top_logprobs,
)
from services.llm.settings import LlmSettings, llm_settings
from services.llm.stopping import Finish, StopChecker

DECODE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]

FINISH_REASONS = {
    Finish.LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: sampling_pb2.FINISH_REASON_EOS,
}


def format_problem(
    got: kv_cache_pb2.KvFormat, reads: tuple[kv_cache_pb2.KvFormat, ...]
) -> str | None:
    """Why KV of format `got` cannot continue here, or None: it must match the format of
    `reads` its engine writes. A handle without a format is torch KV of an unnamed model
    (prefill before KvFormat existed)."""
    engine = got.engine or "torch"
    ours = next((known for known in reads if known.engine == engine), None)
    if ours is None:
        readable = " or ".join(known.engine for known in reads)
        return f"the KV was made by the {engine} engine; this decode worker reads {readable}"
    if got.model_sha256 and got.model_sha256 != ours.model_sha256:
        return (
            f"the KV was made by model sha256 {got.model_sha256[:12]}..., this decode worker "
            f"serves {ours.model_sha256[:12]}..."
        )
    for name in ("engine_version", "kv_types", "layout"):
        theirs, mine = getattr(got, name), getattr(ours, name)
        if theirs != mine:
            return f"the KV's {name} is {theirs!r}; this decode worker reads {mine!r}"
    return None


def state_bytes_limit(config: LlamaConfig, num_tokens: int) -> int:
    """The most bytes an engine's sequence state of `num_tokens` may take: every layer's K
    and V at four bytes an element (llama.cpp's f16 cache takes half), plus 1 MiB of
    headers. A handle announcing more is refused before anything is allocated for it."""
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    return num_tokens * per_token + 1024 * 1024


def _chunk(
    tokens: list[int], logprobs: list[float], top: list[sampling_pb2.TopLogprobs]
) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(
        chunk=decode_pb2.TokenChunk(token_ids=tokens, logprobs=logprobs, top_logprobs=top)
    )


class DecodeWorker(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, server: MeshServer, settings: LlmSettings, sources: PrefillSources) -> None:
        self.server = server
        self.settings = settings
        self.sources = sources
        # Set by the warm-up; MeshServer answers every call NOT_READY until it has run.
        self.engine: DecodeEngine
        self.reads: tuple[kv_cache_pb2.KvFormat, ...]
        self.vocabularies: Vocabularies
        self.releaser = KvReleaser(server.channels)

    def _validate(self, request: decode_pb2.DecodeRequest, engine: DecodeEngine):
        """The router validated the request; this guards the engine (ids, the KV's shape,
        the room in the context) against a caller that did not go through it."""
        config = engine.config
        violations = Violations()
        handle = request.kv_handle
        prompt = list(request.prompt_token_ids)
        check_prompt(prompt, config.vocab_size, self.settings, violations, "prompt_token_ids")
        if violations.check(request.HasField("kv_handle"), "kv_handle", "is required"):
            # KV this worker cannot continue: its format decides what else it must hold.
            if problem := format_problem(handle.format, self.reads):
                raise Conflict(problem, reason="KV_FORMAT_MISMATCH")
            violations.check(
                HANDLE_ID.fullmatch(handle.id) is not None, "kv_handle.id", HANDLE_ID_RULE
            )
            violations.check(bool(handle.address), "kv_handle.address", "must not be empty")
            violations.check(
                handle.num_tokens == len(prompt),
                "kv_handle.num_tokens",
                f"is {handle.num_tokens} but the prompt has {len(prompt)} tokens",
            )
            if handle.format.engine == "llama.cpp":
                limit = state_bytes_limit(config, handle.num_tokens)
                violations.check(
                    0 < handle.format.state_bytes <= limit,
                    "kv_handle.format.state_bytes",
                    f"must be in [1, {limit}] for {handle.num_tokens} tokens",
                )
            else:
                expected = (config.num_layers, config.num_kv_heads, config.head_dim)
                got = (handle.num_layers, handle.num_kv_heads, handle.head_dim)
                violations.check(
                    got == expected,
                    "kv_handle",
                    f"KV of shape {got} does not fit this model's {expected}",
                )
                # KV of another dtype (prefill resolved 'auto' on other hardware) is
                # converted as it is copied into this worker's cache.
                violations.check(
                    handle.dtype in kv_codec.DTYPES,
                    "kv_handle.dtype",
                    f"{handle.dtype!r} is none of {sorted(kv_codec.DTYPES)}",
                )
        violations.check(
            request.first_token_id < config.vocab_size,
            "first_token_id",
            "is outside the vocabulary",
        )
        params = sampling_params(
            request.sampling, config.vocab_size, violations, end_token=end_token(config)
        )
        first_top = request.first_token_top_logprobs
        violations.check(
            len(first_top.token_ids) == len(first_top.logprobs) <= params.top_logprobs,
            "first_token_top_logprobs",
            f"must pair at most sampling.top_logprobs ({params.top_logprobs}) ids and logprobs",
        )
        if prompt:
            decode_length(request.max_new_tokens, len(prompt), engine.max_seq_len, violations)
        violations.check(
            not (request.ignore_eos and request.sampling.HasField("constraint")),
            "ignore_eos",
            "cannot be combined with sampling.constraint",
        )
        violations.raise_if_any()
        return prompt, params

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        received = time.perf_counter()
        engine = self.engine
        prompt, params = self._validate(request, engine)
        handle = request.kv_handle
        if not await self.sources.allows(handle.address):
            problem = (
                "is not a prefill worker this decode worker pulls from ([services.decode] prefill)"
            )
            raise InvalidInput([FieldViolation("kv_handle.address", problem)])
        guide = None
        if request.sampling.HasField("constraint"):
            # Past the first token, which prefill sampled under the same mask (unless it
            # ended the output).
            first = request.first_token_id
            after = () if first in engine.config.eos_token_ids else (first,)
            guide = await asyncio.to_thread(
                self.vocabularies.guide, request.sampling.constraint, after
            )
        checker = StopChecker(
            max_new_tokens=request.max_new_tokens,
            eos_ids=frozenset(engine.config.eos_token_ids),
            ignore_eos=request.ignore_eos,
        )
        # The first token streams at once, before any KV moves: that is the caller's TTFT.
        first = checker.feed(request.first_token_id, room_left=len(prompt) + 1 < engine.max_seq_len)
        if first:
            top = [request.first_token_top_logprobs] if params.top_logprobs else []
            yield _chunk(first, [request.first_token_logprob], top)
        if checker.finish is not None:
            self.releaser.release_later(handle.address, handle.id)
            yield self._complete(checker, received, 0.0, 0.0)
            return

        pulled_at = time.perf_counter()
        try:
            kv = await kv_transfer.pull(self.server.channels, handle)
        finally:
            self.releaser.release_later(handle.address, handle.id)
        # The handoff, on Decode's span: which engine's KV, and how many bytes moved.
        trace.get_current_span().set_attributes(
            {
                "aimesh.kv.engine": handle.format.engine or "torch",
                "aimesh.kv.bytes": kv_codec.kv_nbytes(kv),
            }
        )
        # Part of the handoff, off the event loop and the model thread: converting a long
        # prompt's KV in a step would hold up every running sequence's next token.
        kv = await asyncio.to_thread(engine.slots.readable, kv)
        transfer_s = time.perf_counter() - pulled_at

        sequence = Sequence(
            prompt=prompt,
            kv=kv,
            first_token=request.first_token_id,
            params=params,
            stop=checker,
            guide=guide,
        )
        engine.submit(sequence)
        try:
            while True:
                emissions = [await sequence.outbox.get()]
                while not sequence.outbox.empty():  # coalesce when the reader fell behind
                    emissions.append(sequence.outbox.get_nowait())
                if error := next((e.error for e in emissions if e.error), None):
                    raise error
                if tokens := [t for e in emissions for t in e.tokens]:
                    yield _chunk(
                        tokens,
                        [p for e in emissions for p in e.logprobs],
                        [top_logprobs(t) for e in emissions for t in e.top],
                    )
                if any(e.finish for e in emissions):
                    break
        finally:
            engine.cancel(sequence)
        queue_s = (sequence.joined_at or time.perf_counter()) - sequence.submitted_at
        yield self._complete(checker, received, transfer_s, queue_s)

    def _complete(
        self, checker: StopChecker, received: float, transfer_s: float, queue_s: float
    ) -> decode_pb2.DecodeResponse:
        total = time.perf_counter() - received
        return decode_pb2.DecodeResponse(
            complete=decode_pb2.DecodeComplete(
                finish_reason=FINISH_REASONS[checker.finish],
                generated_tokens=checker.generated,
                timing=common_pb2.Timing(
                    stages=[
                        stage("kv_transfer", transfer_s, common_pb2.STAGE_KIND_TRANSFER),
                        stage("queue", queue_s, common_pb2.STAGE_KIND_QUEUE),
                        stage(
                            "decode", total - transfer_s - queue_s, common_pb2.STAGE_KIND_COMPUTE
                        ),
                    ],
                    total_ns=int(total * 1e9),
                ),
            )
        )

    async def GetLoad(
        self, request: decode_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.GetLoadResponse:
        engine = self.engine
        total_blocks = engine.max_batch_size * engine.max_seq_len // BLOCK_TOKENS
        used_blocks = sum(-(-(s.position + 1) // BLOCK_TOKENS) for s in engine.running)
        return decode_pb2.GetLoadResponse(
            running=len(engine.running),
            waiting=len(engine.waiting) + self.server.admission.waiting,
            kv_cache_usage=used_blocks / total_blocks,
            max_batch_size=engine.max_batch_size,
            kv_blocks_total=total_blocks,
            kv_blocks_free=total_blocks - used_blocks,
        )


async def setup(server: MeshServer) -> None:
    settings = llm_settings(server.settings)
    options = server.options_as(DecodeOptions)
    sources = PrefillSources(options.prefill or [server.dependency_target("prefill")])
    worker = DecodeWorker(server, settings, sources)
    server.add_service(decode_pb2_grpc.add_DecodeServiceServicer_to_server, worker, DECODE)

    def load() -> DecodeEngine:
        served = load_served(
            settings, server.settings.cache_dir, phase="decode", sequences=settings.max_batch_size
        )
        model = served.model
        slots = (
            TorchSlots(model, settings.max_batch_size, settings.max_seq_len)
            if isinstance(model, Llama)
            else model
        )
        worker.reads = served.reads
        worker.vocabularies = Vocabularies(
            lambda: model_directory(settings, server.settings.cache_dir),
            model.config.vocab_size,
            model.config.eos_token_ids,
        )
        server.describe(served.info)
        return DecodeEngine(slots, settings.max_batch_size, settings.max_seq_len)

    async def warm_up() -> None:
        engine = await asyncio.to_thread(load)
        await asyncio.get_running_loop().run_in_executor(engine.model_thread, engine.warm_up)
        server.watch(engine.start(), on_death=engine.fail_all)
        worker.engine = engine

    async def shut_down() -> None:
        if hasattr(worker, "engine"):  # not when a signal ended the warm-up
            await worker.engine.stop()

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
