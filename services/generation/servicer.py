"""The external text-generation API: Generate and Chat, validated here once, metered here
once (every generation passes this router, whichever door it came in by: mesh/metering.py),
run by an engine that streams token ids, made into text here once, reported with usage
and per-stage timing."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Protocol

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import (
    decode_pb2,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2_grpc,
    sampling_pb2,
)
from mesh import caller, request_id
from mesh.artifacts import sha256_of
from mesh.deployments import Deployment, open_store
from mesh.failures import InvalidInput, QuotaExceeded
from mesh.health import probe
from mesh.info import ModelInfo
from mesh.metering import Meter, MeterUnavailable
from mesh.rpc import incoming
from mesh.server import MeshServer
from mesh.store_health import StoreHealth
from mesh.streams import interleaved
from mesh.timing import stage
from mesh.triton import TritonModel
from mesh.validation import Violations
from services.generation import tool_calls
from services.generation.canary_rule import CanaryRule
from services.generation.models import MODELS, ModelServicer, guard_canaries
from services.generation.on_triton import TritonGeneration
from services.generation.pipeline import Outcome, Pipeline
from services.generation.settings import RouterOptions
from services.generation.text import TextStream
from services.generation.tokenize import TOKENIZER, TokenizerClient
from services.generation.versions import Pool, Route, Versions, warm_generation
from services.generation.workers import DecodePicker, PrefillPicker
from services.llm import metrics
from services.llm.artifacts import load_tokenizer, model_directory
from services.llm.described import described, model_name
from services.llm.guide import grammar_of
from services.llm.prefix import MAX_CACHE_SALT_BYTES
from services.llm.requests import Stopping, sampling_params, stopping
from services.llm.settings import LlmSettings, llm_settings

log = logging.getLogger(__name__)

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
# Ends of a generation that say nothing of the version that served it.
_NOT_THE_VERSIONS = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
MAX_PROMPT_BYTES = 1024 * 1024
MAX_MESSAGES = 256
MAX_CHOICES = 32
MAX_CHOICE_BYTES = 256
ROLES = frozenset({"system", "user", "assistant", "tool"})
# The router does not hold the vocabulary; prefill checks top_k against the real one.
_ANY_VOCAB = 2**31 - 1


class Engine(Protocol):
    """What generates the tokens: aimesh's prefill and decode workers, or Triton."""

    def unsupported(
        self, sampling: sampling_pb2.SamplingParameters, violations: Violations
    ) -> None:
        """Adds a violation for each option of the request this engine cannot honour."""

    def choices(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: sampling_pb2.SamplingParameters,
        limits: Stopping,
        outcomes: list[Outcome],
        *,
        cache_salt: str = "",
    ) -> AbstractAsyncContextManager[list[AsyncIterator[decode_pb2.TokenChunk]]]:
        """A stream of token ids (with their logprobs) per choice (sampling.n, one
        Outcome each, filled in as it goes), open for the block. Closing a stream early
        cancels its generation. A prefix cache below is scoped by the caller's client and
        `cache_salt`."""
        ...


_KINDS = {
    "tokenize": common_pb2.STAGE_KIND_COMPUTE,
    "queue": common_pb2.STAGE_KIND_QUEUE,
    "prefix_cache": common_pb2.STAGE_KIND_COMPUTE,
    "prefill": common_pb2.STAGE_KIND_COMPUTE,
    "kv_transfer": common_pb2.STAGE_KIND_TRANSFER,
    "decode": common_pb2.STAGE_KIND_COMPUTE,
    "detokenize": common_pb2.STAGE_KIND_COMPUTE,
}


class GenerationRouter(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, settings: LlmSettings, rule: CanaryRule, meter: Meter) -> None:
        self.settings = settings
        self.rule = rule
        self.meter = meter
        # Which version serves a request, set by the warm-up once the mesh's own model
        # (its tokenizer.json) is loaded; MeshServer answers every call NOT_READY until then.
        self.versions: Versions

    def _route(self, request, context, violations: Violations) -> Route | None:
        """Where the request runs: its model, and the version its user gets."""
        # Who the request is for, when a canary splits users; none: the active version.
        user = incoming(context, caller.USER_METADATA_KEY, caller.MAX_USER_BYTES + 1) or ""
        violations.max_length(
            user.encode(), f"metadata {caller.USER_METADATA_KEY}", caller.MAX_USER_BYTES
        )
        if not self.versions.knows(request.model):
            violations.add(
                "model", f"unknown model {request.model!r}; served: {self.versions.models()}"
            )
            return None
        return self.versions.route(request.model, user)

    def _check_common(self, request, route: Route | None, violations: Violations) -> None:
        violations.max_length(request.cache_salt.encode(), "cache_salt", MAX_CACHE_SALT_BYTES)
        sampling_params(request.sampling, _ANY_VOCAB, violations)
        if route is not None:
            route.pool.engine.unsupported(request.sampling, violations)
        choices = request.sampling.choices
        violations.check(
            len(choices) <= MAX_CHOICES and len(set(choices)) == len(choices),
            "sampling.choices",
            f"must be at most {MAX_CHOICES} distinct strings, got {len(choices)}",
        )
        for i, choice in enumerate(choices[:MAX_CHOICES]):
            violations.check(bool(choice), f"sampling.choices[{i}]", "must not be empty")
            violations.max_length(choice.encode(), f"sampling.choices[{i}]", MAX_CHOICE_BYTES)
        violations.check(
            not request.sampling.choice_token_ids,
            "sampling.choice_token_ids",
            "is filled in by the router; set sampling.choices",
        )
        violations.check(
            not (choices and request.stopping.ignore_eos),
            "stopping.ignore_eos",
            "cannot be combined with sampling.choices",
        )
        violations.check(
            not (request.sampling.HasField("constraint") and request.stopping.ignore_eos),
            "stopping.ignore_eos",
            "cannot be combined with sampling.constraint",
        )
        stopping(request.stopping, 0, self.settings, violations)

    @staticmethod
    async def _check_constraint(request) -> None:
        """A constraint that does not compile is refused here, once, naming the compiler's
        message; prefill and decode, which build its matcher, then only meet good ones.
        In a thread: a large schema takes milliseconds to check."""
        if request.sampling.HasField("constraint"):
            violations = Violations()
            await asyncio.to_thread(grammar_of, request.sampling.constraint, violations)
            violations.raise_if_any()

    async def _guided(
        self, rid: str, request, prompt_tokens: int, limits: Stopping, pool: Pool
    ) -> tuple[sampling_pb2.SamplingParameters, Stopping]:
        """The request's sampling with its choices tokenized for prefill and decode, and
        room for the longest choice (plus its end token) when no length was asked for."""
        choices = request.sampling.choices
        if not choices:
            return request.sampling, limits
        sampling = sampling_pb2.SamplingParameters()
        sampling.CopyFrom(request.sampling)
        tokenized = await asyncio.gather(
            *(pool.tokenizer.tokenize(choice, rid, add_special_tokens=False) for choice in choices)
        )
        for ids in tokenized:
            sampling.choice_token_ids.add(ids=ids)
        if not request.stopping.HasField("max_new_tokens"):
            longest = max(map(len, tokenized)) + 1
            room = self.settings.max_seq_len - prompt_tokens
            limits = dataclasses.replace(limits, max_new_tokens=min(longest, room))
        return sampling, limits

    def _limits(self, request, prompt_ids: list[int], field: str) -> Stopping:
        """The request's stopping with its defaults resolved for this prompt: the
        validated form prefill, decode and Triton receive."""
        violations = Violations()
        violations.check(
            len(prompt_ids) < self.settings.max_seq_len,
            field,
            f"{len(prompt_ids)} tokens leave no room in the {self.settings.max_seq_len}-token "
            "context window",
        )
        violations.raise_if_any()
        limits = stopping(request.stopping, len(prompt_ids), self.settings, violations)
        violations.raise_if_any()
        return limits

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        received = time.perf_counter()
        violations = Violations()
        violations.check(bool(request.prompt), "prompt", "must not be empty")
        violations.max_length(request.prompt.encode(), "prompt", MAX_PROMPT_BYTES)
        route = self._route(request, context, violations)
        self._check_common(request, route, violations)
        violations.raise_if_any()
        await self._check_constraint(request)
        assert route is not None
        rid = request_id.ensure(request.request_id)
        with self.versions.running(route) as pool:
            prompt_ids = await pool.tokenizer.tokenize(request.prompt, rid)
            async for event in self._judged(rid, prompt_ids, request, "prompt", received, route):
                yield generation_pb2.GenerateResponse(**event)

    async def Chat(
        self, request: generation_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.ChatResponse]:
        received = time.perf_counter()
        violations = Violations()
        violations.check(
            0 < len(request.messages) <= MAX_MESSAGES,
            "messages",
            f"must hold 1 to {MAX_MESSAGES} messages, got {len(request.messages)}",
        )
        for i, message in enumerate(request.messages[:MAX_MESSAGES]):
            violations.check(
                message.role in ROLES, f"messages[{i}].role", f"must be one of {sorted(ROLES)}"
            )
        # The tokenizer renders at most this much content per conversation, in all.
        total = sum(len(m.content.encode()) for m in request.messages[:MAX_MESSAGES])
        violations.check(
            total <= MAX_PROMPT_BYTES,
            "messages",
            f"contents must be at most {MAX_PROMPT_BYTES} bytes in all, got {total}",
        )
        route = self._route(request, context, violations)
        self._check_common(request, route, violations)
        tool_calls.check(request, violations)
        violations.raise_if_any()
        await self._check_constraint(request)
        assert route is not None
        rid = request_id.ensure(request.request_id)
        tooling = None
        if tool_calls.uses_tools(request):
            template = await route.pool.tokenizer.template(rid)
            tooling = tool_calls.plan(request, template.tool_format, "system" in template.roles)
        if tooling is not None:
            await asyncio.to_thread(tool_calls.compile_problem, tooling, violations)
            request = _with_tools_planned(request, tooling)
            # The engine must enforce the envelope (Triton's does not take constraints).
            route.pool.engine.unsupported(request.sampling, violations)
            violations.raise_if_any()
        with self.versions.running(route) as pool:
            prompt_ids = await pool.tokenizer.apply_chat_template(
                rid, list(request.messages), tools=tooling.tools if tooling else ""
            )
            events = self._judged(rid, prompt_ids, request, "messages", received, route)
            if tooling is not None and tooling.constraint is not None:
                parser = functools.partial(
                    tool_calls.CallParser, tooling.answer_is_text, tooling.format
                )
                events = _calls_apart(events, parser)
            async for event in events:
                yield generation_pb2.ChatResponse(**event)

    async def _judged(
        self, rid: str, prompt_ids: list[int], request, field: str, received: float, route: Route
    ) -> AsyncIterator[dict]:
        """The generation, counted for its version (outcome, time to first token) and
        recorded for the canary rule. A refusal of the request (bad input) and a caller
        that left, or its tenant's limits, are not the version's failures."""
        first_token_s: list[float] = []
        outcome = "error"
        try:
            async for event in self._stream(rid, prompt_ids, request, field, received, route):
                if "complete" in event:
                    outcome = _outcome_name(event["complete"].finish_reason)
                elif not first_token_s:
                    first_token_s.append(time.perf_counter() - received)
                yield event
        except (
            InvalidInput,
            QuotaExceeded,
            MeterUnavailable,
            asyncio.CancelledError,
            GeneratorExit,
        ):
            outcome = ""
            raise
        except grpc.aio.AioRpcError as error:
            if error.code() in _NOT_THE_VERSIONS:
                outcome = ""
            raise
        finally:
            if outcome and route.version:
                metrics.VERSION_REQUESTS.labels(route.model, route.version, outcome).inc()
                ttft = first_token_s[0] if first_token_s else None
                if ttft is not None:
                    metrics.VERSION_TIME_TO_FIRST_TOKEN.labels(route.model, route.version).observe(
                        ttft
                    )
                self.rule.record(route.model, route.version, failed=outcome == "error", ttft_s=ttft)

    async def _stream(
        self, rid: str, prompt_ids: list[int], request, field: str, received: float, route: Route
    ) -> AsyncIterator[dict]:
        """The generation of a tokenized prompt (`field` names it in a refusal)."""
        pool = route.pool
        limits = self._limits(request, prompt_ids, field)
        tokenize_s = time.perf_counter() - received
        sampling, limits = await self._guided(rid, request, len(prompt_ids), limits, pool)
        sampling = _seeded(sampling)
        tenant = caller.current()
        if self.meter.limits(tenant).counts_tokens and not request.stopping.HasField(
            "max_new_tokens"
        ):
            # What an unbounded request reserves is then its bound (OpenAI's max_tokens
            # default works the same way against a quota).
            length = min(limits.max_new_tokens, self.meter.reserve_tokens)
            limits = dataclasses.replace(limits, max_new_tokens=length)
        outcomes = [Outcome() for _ in range(sampling.n or 1)]
        reservation = await self.meter.reserve(
            tenant, len(prompt_ids) + len(outcomes) * limits.max_new_tokens
        )
        clock = (received, tokenize_s)
        try:
            async for event in self._generated(
                rid, prompt_ids, request, clock, route, sampling, limits, outcomes
            ):
                yield event
        finally:
            # However the request ended: the prompt is paid for once it went to the
            # engine (once, however many choices share it), and every token the engine
            # sent, the client gone or not.
            self.meter.settle(
                reservation,
                route.model,
                prompt_tokens=len(prompt_ids) if any(o.prompt_sent for o in outcomes) else 0,
                completion_tokens=sum(o.generated_tokens for o in outcomes),
            )

    async def _generated(
        self,
        rid: str,
        prompt_ids: list[int],
        request,
        clock: tuple[float, float],
        route: Route,
        sampling: sampling_pb2.SamplingParameters,
        limits: Stopping,
        outcomes: list[Outcome],
    ) -> AsyncIterator[dict]:
        """Each choice's tokens as text chunks, then its complete message, the choices
        interleaved as they come; `clock` is when the request was received and how long
        its tokenizing took."""
        received, tokenize_s = clock
        pool = route.pool
        engine: Engine = pool.engine  # type: ignore[assignment]
        version_itl = metrics.VERSION_INTER_TOKEN_LATENCY.labels(route.model, route.version)
        pieces = pool.pieces if sampling.logprobs else None
        if pieces is not None:
            await asyncio.to_thread(pieces.load)
        first_token_seen = False

        async def choice(
            index: int, tokens: AsyncIterator[decode_pb2.TokenChunk]
        ) -> AsyncIterator[dict]:
            nonlocal first_token_seen
            outcome = outcomes[index]
            text = TextStream(pool.text_tokenizer, limits.stop_sequences)
            last_token_at: float | None = None
            received_tokens = 0
            detokenize_s = 0.0
            async with aclosing(tokens) as generated:
                async for chunk in generated:
                    ids = list(chunk.token_ids)
                    logprobs = pieces.entries(chunk) if pieces is not None else ()
                    now = time.perf_counter()
                    if not first_token_seen:
                        first_token_seen = True
                        metrics.TIME_TO_FIRST_TOKEN.observe(now - received)
                    if last_token_at is not None:
                        gap = (now - last_token_at) / len(ids)
                        for _ in ids:
                            metrics.INTER_TOKEN_LATENCY.observe(gap)
                            if route.version:
                                version_itl.observe(gap)
                    last_token_at = now
                    received_tokens += len(ids)
                    # Counted as they come, so a generation that ends early reports (and
                    # pays for) every token it received.
                    outcome.generated_tokens = max(outcome.generated_tokens, received_tokens)
                    piece = text.push(ids)
                    detokenize_s += time.perf_counter() - now
                    if text.stopped:
                        # Leaving the block closes the engine's stream: this choice's
                        # decode (or Triton request) is cancelled before its last text.
                        break
                    yield {"chunk": _chunk(piece, ids, logprobs, index)}
            if text.stopped:
                outcome.finish_reason = sampling_pb2.FINISH_REASON_STOP_SEQUENCE
                yield {"chunk": _chunk(piece, ids, logprobs, index)}
            else:
                started = time.perf_counter()
                tail = text.finish()
                detokenize_s += time.perf_counter() - started
                if tail:
                    yield {"chunk": generation_pb2.GenerationChunk(text=tail, index=index)}
            outcome.stages["detokenize"] = detokenize_s
            yield {
                "complete": self._complete(
                    outcome, len(prompt_ids), received, tokenize_s, route, index
                )
            }

        async with engine.choices(
            rid, prompt_ids, sampling, limits, outcomes, cache_salt=request.cache_salt
        ) as streams:
            choices = [choice(index, tokens) for index, tokens in enumerate(streams)]
            try:
                async with aclosing(interleaved(choices)) as events:
                    async for _, event in events:
                        yield event
            finally:
                for each in choices:
                    await each.aclose()
        metrics.E2E_REQUEST_LATENCY.observe(time.perf_counter() - received)

    def _complete(
        self,
        outcome: Outcome,
        prompt_tokens: int,
        received: float,
        tokenize_s: float,
        route: Route,
        index: int,
    ) -> generation_pb2.GenerationComplete:
        stages = {"tokenize": tokenize_s, **outcome.stages}
        return generation_pb2.GenerationComplete(
            finish_reason=outcome.finish_reason,
            usage=common_pb2.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=outcome.generated_tokens,
                total_tokens=prompt_tokens + outcome.generated_tokens,
                cached_tokens=outcome.cached_tokens,
            ),
            timing=common_pb2.Timing(
                stages=[
                    stage(name, seconds, _KINDS[name], tokens=outcome.stage_tokens.get(name, 0))
                    for name, seconds in stages.items()
                ],
                total_ns=int((time.perf_counter() - received) * 1e9),
            ),
            prefill_worker=outcome.prefill_worker,
            decode_worker=outcome.decode_worker,
            model=route.model,
            model_version=route.version,
            index=index,
        )


async def setup(server: MeshServer) -> None:
    settings = llm_settings(server.settings)
    options = server.options_as(RouterOptions)
    # The health probes go around the mesh channel, so that a dependency still starting
    # trips no circuit breaker.
    tokenizer_target = server.dependency_target("tokenizer")
    tokenizer = TokenizerClient(server.channel_to("tokenizer", TOKENIZER))
    own_name = model_name(settings)
    engine: Engine
    if options.triton is not None:
        model = TritonModel(options.triton, server.settings)
        engine = TritonGeneration(model)
        server.add_warmup(lambda: _wait_for_triton(tokenizer_target, model, options))
        server.add_readiness_probe(model.ready)
        server.add_shutdown(model.close)
    else:
        # Several workers of a kind as the options list them, else the declared dependency.
        prefill = options.prefill or [server.dependency_target("prefill")]
        decode = options.decode or [server.dependency_target("decode")]
        decode_picker = DecodePicker(
            decode, server.channels, options.poll_interval_s, server.settings.tls
        )
        engine = Pipeline(server.channels, PrefillPicker(prefill, server.channels), decode_picker)
        server.add_warmup(
            lambda: _wait_for_workers(server, tokenizer_target, prefill, decode_picker)
        )
        server.add_shutdown(decode_picker.stop)
    rule = CanaryRule(options.canary_rule)
    meter = Meter.from_settings(server.settings.limits, server.settings.cache_dir)
    server.add_shutdown(meter.close)
    router = GenerationRouter(settings, rule, meter)
    models = ModelServicer()
    store = open_store(server.settings.deployments, server.settings.cache_dir)
    own_info: list[ModelInfo] = []

    def describe_models() -> None:
        """GetInfo names the mesh's own model and every registered one it routes, so the
        gateway's /v1/models (which reads GetInfo) follows the registry."""
        server.info.models[:] = [
            *own_info,
            *(
                registered_info(deployment, settings)
                for name, deployment in router.versions.serving.items()
                if name != own_name
            ),
        ]

    async def load_models() -> None:
        """The model's tokenizer.json, found as every LLM service finds the model; then
        the registry's versions, routed once warm."""
        directory = await asyncio.to_thread(model_directory, settings, server.settings.cache_dir)
        text_tokenizer = await asyncio.to_thread(load_tokenizer, directory)
        vocabulary = await asyncio.to_thread(sha256_of, directory / "tokenizer.json")
        runs_on = "triton" if options.triton is not None else "prefill+decode"
        own_info.append(described(directory, settings, engine=runs_on))
        versions = Versions(
            store=store,
            own=Pool(own_name, "", engine, tokenizer, text_tokenizer),
            channels=server.channels,
            tls=server.settings.tls,
            poll_interval_s=options.registry_poll_s,
            warm_timeout_s=options.warm_timeout_s,
            warm_up=lambda pool: warm_generation(pool, request_id.ensure("")),
            watch=server.watch,
            unwatch=server.unwatch,
            tokenizers={vocabulary: text_tokenizer},
            on_applied=describe_models,
            health=StoreHealth("registry", health=server.health, service=server.name),
        )
        router.versions = models.versions = versions
        server.add_shutdown(versions.close)
        # A registry that cannot be read or is invalid does not stop the start: the
        # router serves its own model, reports the registry (health, metrics, one log
        # line) and the follower applies it once it can be read.
        await versions.look()
        describe_models()
        server.watch(asyncio.create_task(versions.follow(), name="registry-follow"))
        server.watch(
            asyncio.create_task(
                guard_canaries(versions, rule, options.registry_poll_s), name="canary-rule"
            )
        )

    server.add_warmup(load_models)
    server.add_service(
        generation_pb2_grpc.add_GenerationServiceServicer_to_server, router, GENERATION
    )
    server.add_service(models_pb2_grpc.add_ModelServiceServicer_to_server, models, MODELS)


def registered_info(deployment: Deployment, settings: LlmSettings) -> ModelInfo:
    """A registered model's GetInfo entry: its active version and that version's artifact."""
    version = deployment.versions[deployment.active] if deployment.active else None
    artifact = version.artifact if version else None
    return ModelInfo(
        name=deployment.model,
        revision=deployment.active or "",
        sha256=artifact.sha256 if artifact else "",
        engine=version.engine if version else "",
        limits={"max_seq_len": str(settings.max_seq_len)},
    )


def _chunk(
    text: str, ids: list[int], logprobs: Iterable[generation_pb2.TokenLogprob], index: int
) -> generation_pb2.GenerationChunk:
    return generation_pb2.GenerationChunk(text=text, token_ids=ids, logprobs=logprobs, index=index)


def _seeded(sampling: sampling_pb2.SamplingParameters) -> sampling_pb2.SamplingParameters:
    """A request that gave no seed gets a fresh one here, once, so that prefill's first
    token and decode's later ones draw from one stream, and two such requests differ
    (the sampler reads an unset seed as 0: every unseeded request drew alike)."""
    if sampling.HasField("seed"):
        return sampling
    seeded = sampling_pb2.SamplingParameters()
    seeded.CopyFrom(sampling)
    seeded.seed = secrets.randbits(63)
    return seeded


def _with_tools_planned(
    request: generation_pb2.ChatRequest, tooling: tool_calls.Plan
) -> generation_pb2.ChatRequest:
    """The request as the pipeline runs it: the conversation any template renders, and
    the envelope as its constraint."""
    planned = generation_pb2.ChatRequest()
    planned.CopyFrom(request)
    del planned.messages[:]
    planned.messages.extend(tooling.messages)
    if tooling.constraint is not None:
        planned.sampling.constraint.CopyFrom(tooling.constraint)
    return planned


async def _calls_apart(
    events: AsyncIterator[dict], parser: Callable[[], tool_calls.CallParser]
) -> AsyncIterator[dict]:
    """The constrained output taken apart as it streams, each choice by a `parser` of
    its own: each chunk's text becomes the answer's text and the calls' deltas; the end
    carries the calls, whole, and says the turn ended in them."""
    parsers: dict[int, tool_calls.CallParser] = collections.defaultdict(parser)
    async for event in events:
        if "chunk" in event:
            chunk = event["chunk"]
            text, deltas = parsers[chunk.index].feed(chunk.text)
            event = {
                "chunk": generation_pb2.GenerationChunk(
                    text=text,
                    token_ids=chunk.token_ids,
                    tool_calls=deltas,
                    logprobs=chunk.logprobs,
                    index=chunk.index,
                )
            }
        elif calls := parsers[event["complete"].index].calls:
            complete = event["complete"]
            complete.tool_calls.extend(calls)
            if complete.finish_reason == sampling_pb2.FINISH_REASON_EOS:
                complete.finish_reason = sampling_pb2.FINISH_REASON_TOOL_CALLS
        yield event


def _outcome_name(finish_reason: int) -> str:
    return sampling_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()


async def _wait_for_workers(
    server: MeshServer, tokenizer: str, prefill: list[str], decode_picker: DecodePicker
) -> None:
    """Ready once the pipeline can run: the tokenizer, a prefill and a decode worker
    answer. Only at start; later outages show as errors, not as an unready router."""
    await decode_picker.poll()
    while not (
        decode_picker.any_healthy
        and await probe(tokenizer, "tokenizer", tls=server.settings.tls) == "SERVING"
        and any([await probe(t, "prefill", tls=server.settings.tls) == "SERVING" for t in prefill])
    ):
        await asyncio.sleep(decode_picker.poll_interval_s)
        await decode_picker.poll()
    server.watch(decode_picker.start())


async def _wait_for_triton(tokenizer: str, model: TritonModel, options: RouterOptions) -> None:
    """Ready once the tokenizer answers and Triton has the model; afterwards readiness
    follows Triton's ModelReady (a remote model has no local event to wait on)."""
    while not (await probe(tokenizer, "tokenizer") == "SERVING" and await model.ready()):  # noqa: ASYNC110
        await asyncio.sleep(options.poll_interval_s)
