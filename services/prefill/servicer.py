"""The prefill worker's gRPC surface: PrefillService and KvCacheService in one process,
since this process owns the KV tensors that Pull streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import propagate

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import kv_cache_pb2, kv_cache_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from mesh import caller
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.llm import kv_codec
from services.llm.artifacts import model_directory
from services.llm.described import load_served
from services.llm.guide import Vocabularies
from services.llm.kv_transfer import HANDLE_ID, HANDLE_ID_RULE
from services.llm.prefix import MAX_CACHE_SALT_BYTES, cache_scope
from services.llm.requests import check_prompt, end_token, sampling_params, top_logprobs
from services.llm.settings import LlmSettings, llm_settings
from services.prefill.engine import KvStore, Lease, PrefillEngine
from services.prefill.prefix_cache import PrefixCache
from services.prefill.settings import PrefillOptions

DEFAULT_LEASE_S = 30.0
MAX_LEASE_S = 300.0
REAP_INTERVAL_S = 1.0

PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]
KV_CACHE = kv_cache_pb2.DESCRIPTOR.services_by_name["KvCacheService"]


def check_handle_id(handle_id: str, violations: Violations, field: str = "handle_id") -> None:
    """Pull and Release take only ids this service could have issued, and say so rather
    than NOT_FOUND for one it never could; a release token has the same form (a made-up
    token of a megabyte would otherwise be remembered, as a tombstone, at that size)."""
    violations.check(HANDLE_ID.fullmatch(handle_id) is not None, field, HANDLE_ID_RULE)


class PrefillWorker(
    prefill_pb2_grpc.PrefillServiceServicer, kv_cache_pb2_grpc.KvCacheServiceServicer
):
    def __init__(self, server: MeshServer, settings: LlmSettings) -> None:
        self.server = server
        self.settings = settings
        self.options = server.options_as(PrefillOptions)
        self.store = KvStore(settings.kv_store_bytes)
        # Set by the warm-up; MeshServer answers every call NOT_READY until it has run.
        self.engine: PrefillEngine
        self.kv_format: kv_cache_pb2.KvFormat
        self.vocabularies: Vocabularies
        # One model thread: a forward pass already uses every core torch is given.
        self.model_thread = server.executor("model")

    @property
    def address(self) -> str:
        advertised = self.options.advertise_address
        host = "127.0.0.1" if self.server.host in ("0.0.0.0", "::") else self.server.host
        return advertised or f"{host}:{self.server.port}"

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        received = time.perf_counter()
        engine = self.engine
        config = engine.model.config
        violations = Violations()
        token_ids = list(request.token_ids)
        check_prompt(token_ids, config.vocab_size, self.settings, violations, "token_ids")
        params = sampling_params(
            request.sampling, config.vocab_size, violations, end_token=end_token(config)
        )
        violations.check(request.lease_ttl_ms >= 0, "lease_ttl_ms", "must not be negative")
        violations.max_length(request.cache_salt.encode(), "cache_salt", MAX_CACHE_SALT_BYTES)
        if request.release_token:
            check_handle_id(request.release_token, violations, "release_token")
        violations.raise_if_any()
        ttl_s = min(request.lease_ttl_ms / 1000 or DEFAULT_LEASE_S, MAX_LEASE_S)
        guide = None
        if request.sampling.HasField("constraint"):
            guide = await asyncio.to_thread(self.vocabularies.guide, request.sampling.constraint)

        loop = asyncio.get_running_loop()
        queued = time.perf_counter()
        owner = caller.current()
        client = owner if self.options.prefix_cache_scope == "tenant" else ""
        scope = cache_scope(client, request.cache_salt)
        choices = request.sampling.n or 1
        result = await loop.run_in_executor(
            self.model_thread, engine.run, token_ids, params, scope, guide, choices
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        lease, *others = self.store.put_shared(
            result.kv, ttl_s, choices, carrier.get("traceparent", ""), owner, request.release_token
        )

        # A caller that gave up before this answer was sent never learns the ids: the KV
        # goes now instead of at the end of its lease. (One that gives up while the answer
        # is on its way releases by its release token.)
        def drop_if_undelivered(call: grpc.aio.ServicerContext) -> None:
            if call.cancelled():
                for handle_id in list(lease.readers):
                    self.store.release(handle_id, owner)

        context.add_done_callback(drop_if_undelivered)

        def handle(lease: Lease) -> kv_cache_pb2.KvHandle:
            return kv_cache_pb2.KvHandle(
                id=lease.handle_id,
                address=self.address,
                num_tokens=lease.num_tokens,
                lease_expires_unix_ms=lease.expires_unix_ms,
                traceparent=lease.traceparent,
                **kv_codec.handle_fields(result.kv, self.kv_format),
            )

        waited = time.perf_counter() - queued - result.compute_s - result.lookup_s
        return prefill_pb2.PrefillResponse(
            first_token_id=result.first_token,
            first_token_logprob=result.logprob,
            first_token_top_logprobs=top_logprobs(result.top) if result.top else None,
            kv_handle=handle(lease),
            other_choices=[
                prefill_pb2.ChoiceStart(
                    first_token_id=draw.token,
                    first_token_logprob=draw.logprob,
                    first_token_top_logprobs=top_logprobs(draw.top) if draw.top else None,
                    kv_handle=handle(other),
                )
                for draw, other in zip(result.others, others, strict=True)
            ],
            prompt_tokens=len(token_ids),
            cached_tokens=result.cached_tokens,
            timing=common_pb2.Timing(
                stages=[
                    stage("queue", max(waited, 0.0), common_pb2.STAGE_KIND_QUEUE),
                    stage(
                        "prefix_cache",
                        result.lookup_s,
                        common_pb2.STAGE_KIND_COMPUTE,
                        tokens=result.cached_tokens,
                    ),
                    stage(
                        "prefill",
                        result.compute_s,
                        common_pb2.STAGE_KIND_COMPUTE,
                        tokens=len(token_ids) - result.cached_tokens,
                    ),
                ],
                total_ns=int((time.perf_counter() - received) * 1e9),
            ),
        )

    async def Pull(
        self, request: kv_cache_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_cache_pb2.PullResponse]:
        started = time.perf_counter()
        violations = Violations()
        check_handle_id(request.handle_id, violations)
        violations.check(request.max_chunk_bytes >= 0, "max_chunk_bytes", "must not be negative")
        violations.raise_if_any()
        lease = self.store.get(request.handle_id, caller.current())
        count = 0
        total = 0
        for chunk in kv_codec.encode(lease.kv, kv_codec.clamp_chunk_bytes(request.max_chunk_bytes)):
            count += 1
            total += len(chunk.data)
            yield kv_cache_pb2.PullResponse(chunk=chunk)
        yield kv_cache_pb2.PullResponse(
            complete=kv_cache_pb2.PullComplete(
                num_chunks=count,
                total_bytes=total,
                timing=common_pb2.Timing(
                    stages=[
                        stage("send", time.perf_counter() - started, common_pb2.STAGE_KIND_TRANSFER)
                    ],
                    total_ns=int((time.perf_counter() - started) * 1e9),
                ),
            )
        )

    async def Release(
        self, request: kv_cache_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_cache_pb2.ReleaseResponse:
        violations = Violations()
        by_token = bool(request.release_token)
        violations.check(
            by_token != bool(request.handle_id),
            "handle_id",
            "exactly one of handle_id and release_token must be given",
        )
        if by_token:
            check_handle_id(request.release_token, violations, "release_token")
        elif request.handle_id:
            check_handle_id(request.handle_id, violations)
        violations.raise_if_any()
        owner = caller.current()
        released = (
            self.store.release_by_token(request.release_token, owner)
            if by_token
            else self.store.release(request.handle_id, owner)
        )
        return kv_cache_pb2.ReleaseResponse(released=released)

    async def reap_expired_leases(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            self.store.expire()


async def setup(server: MeshServer) -> None:
    settings = llm_settings(server.settings)
    worker = PrefillWorker(server, settings)
    server.add_service(prefill_pb2_grpc.add_PrefillServiceServicer_to_server, worker, PREFILL)
    server.add_service(kv_cache_pb2_grpc.add_KvCacheServiceServicer_to_server, worker, KV_CACHE)
    reaper: list[asyncio.Task[None]] = []

    def load() -> PrefillEngine:
        served = load_served(settings, server.settings.cache_dir, phase="prefill", sequences=1)
        # A model whose cache cannot be cut short (sliding window, recurrent) runs every
        # prompt whole, as llama-server does.
        cache_bytes = worker.options.prefix_cache_bytes if served.model.reuses_prefix else 0
        engine = PrefillEngine(
            served.model, PrefixCache(cache_bytes), fixed_passes=worker.options.fixed_passes
        )
        engine.warm_up()
        worker.kv_format = served.kv_format
        worker.vocabularies = Vocabularies(
            lambda: model_directory(settings, server.settings.cache_dir),
            served.model.config.vocab_size,
            served.model.config.eos_token_ids,
        )
        server.describe(served.info)
        return engine

    async def warm_up() -> None:
        worker.engine = await asyncio.get_running_loop().run_in_executor(worker.model_thread, load)
        reaper.append(asyncio.create_task(worker.reap_expired_leases(), name="kv-lease-reaper"))
        server.watch(reaper[-1])

    async def shut_down() -> None:
        for task in reaper:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
