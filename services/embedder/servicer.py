"""The embedder's gRPC surface: validate at the boundary, tokenize, batch, answer.

Tokenizing happens here, before the request joins a batch, because whether an input fits
the model is part of validating it: with truncate unset, an input over the model's 256
tokens is INVALID_ARGUMENT naming `inputs[i]`, as TEI answers. Inputs are capped at
64 KiB of UTF-8 each: with truncate set a client may send a whole document and have its
first (or last) 256 tokens embedded, and 64 KiB bounds what tokenizing one costs (~25 ms
here) far above any text that fits the model uncut (~1-2 KB of English). A request's
inputs, 2 MiB at most, tokenize in a worker thread once they are more than THREAD_MIN_BYTES
of UTF-8 (bytes, not characters: 8,000 emoji are 32 KB).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from functools import partial

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh import request_id
from mesh.artifacts import artifact_digest
from mesh.info import ModelInfo
from mesh.server import MeshServer
from mesh.timing import stage
from mesh.validation import Violations
from services.embedder.backends import TritonBackend
from services.embedder.encoder import Encoder
from services.embedder.engine import EmbedEngine
from services.embedder.settings import EmbedderSettings
from services.shared.minilm import Side, Tokenized

SERVICE = embedder_pb2.DESCRIPTOR.services_by_name["EmbedderService"]

MAX_INPUTS = 32  # the proto's limit (TEI's default max client batch size)
MAX_INPUT_BYTES = 64 * 1024
# Below this many bytes in all, tokenizing inline costs less than a thread hop.
THREAD_MIN_BYTES = 8 * 1024
WARMUP_TEXT = "Embedded once before readiness, so the first caller does not pay for it."

_SIDES: dict[int, Side] = {
    embedder_pb2.TRUNCATION_DIRECTION_UNSPECIFIED: "right",
    embedder_pb2.TRUNCATION_DIRECTION_RIGHT: "right",
    embedder_pb2.TRUNCATION_DIRECTION_LEFT: "left",
}


def _check_request(violations: Violations, request: embedder_pb2.EmbedRequest) -> None:
    violations.check(request_id.is_valid(request.request_id), "request_id", request_id.RULE)
    count = len(request.inputs)
    violations.check(count > 0, "inputs", "must hold at least one text")
    if violations.check(
        count <= MAX_INPUTS, "inputs", f"must hold at most {MAX_INPUTS} texts, got {count}"
    ):  # else not worth scanning (100k inputs): the request fails anyway
        for index, text in enumerate(request.inputs):
            size = len(text.encode())
            if size == 0:
                violations.add(f"inputs[{index}]", "must not be empty")
            elif size > MAX_INPUT_BYTES:
                problem = f"must be at most {MAX_INPUT_BYTES} bytes of UTF-8, got {size}"
                violations.add(f"inputs[{index}]", problem)
    direction = request.truncation_direction
    violations.check(
        direction in _SIDES,
        "truncation_direction",
        f"must be one of {', '.join(embedder_pb2.TruncationDirection.keys())}, got {direction}",
    )


def _check_lengths(violations: Violations, tokenized: Sequence[Tokenized], limit: int) -> None:
    for index, length in enumerate(each.length for each in tokenized):
        if length > limit:
            violations.add(
                f"inputs[{index}]",
                f"is {length} tokens, over the model's maximum of {limit}; set truncate to cut it",
            )


class EmbedderServicer(embedder_pb2_grpc.EmbedderServiceServicer):
    """Serves the engine the warm-up hands it (MeshServer refuses calls before that)."""

    def __init__(self) -> None:
        # Set by the warm-up; MeshServer answers every call NOT_READY until it has run.
        self.engine: EmbedEngine

    async def Embed(
        self, request: embedder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.EmbedResponse:
        received = time.perf_counter()
        engine = self.engine
        violations = Violations()
        _check_request(violations, request)
        violations.raise_if_any()

        encoder = engine.encoder
        cut = _SIDES[request.truncation_direction] if request.truncate else None
        texts = list(request.inputs)
        if sum(len(text.encode()) for text in texts) > THREAD_MIN_BYTES:
            tokenized = await asyncio.to_thread(encoder.tokenizer.tokenize, texts, cut)
        else:
            tokenized = encoder.tokenizer.tokenize(texts, cut)
        if cut is None:
            _check_lengths(violations, tokenized, encoder.model.max_tokens)
            violations.raise_if_any()
        tokenize_s = time.perf_counter() - received

        normalize = request.normalize if request.HasField("normalize") else True
        embedded = await engine.embed([each.ids for each in tokenized], normalize)
        tokens = sum(len(each.ids) for each in tokenized)
        return embedder_pb2.EmbedResponse(
            embeddings=[embedder_pb2.Embedding(values=row.tolist()) for row in embedded.vectors],
            dimensions=encoder.model.dimensions,
            model=encoder.model.name,
            usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
            timing=common_pb2.Timing(
                stages=[
                    stage("tokenize", tokenize_s, common_pb2.STAGE_KIND_COMPUTE),
                    stage("queue", embedded.queue_s, common_pb2.STAGE_KIND_QUEUE),
                    stage("inference", embedded.inference_s, common_pb2.STAGE_KIND_COMPUTE),
                ],
                total_ns=int((time.perf_counter() - received) * 1e9),
            ),
        )


async def setup(server: MeshServer) -> None:
    """Registers the servicer now; loads the model in a thread in the warm-up (exporting
    its ONNX graph takes ~10 s the first time, and liveness must answer meanwhile), then
    embeds one text through the batching engine before readiness."""
    settings = server.options_as(EmbedderSettings)
    servicer = EmbedderServicer()
    server.add_service(embedder_pb2_grpc.add_EmbedderServiceServicer_to_server, servicer, SERVICE)

    async def load() -> None:
        load = partial(Encoder.load, settings, server.settings.cache_dir, server.settings)
        # A Triton client belongs to this event loop; a local model loads in a thread.
        encoder = load() if settings.backend == "triton" else await asyncio.to_thread(load)
        if isinstance(encoder.backend, TritonBackend):
            await encoder.backend.model.wait_until_ready()
            server.add_readiness_probe(encoder.backend.model.ready)
        engine = EmbedEngine(
            encoder,
            settings.max_batch_texts,
            settings.max_wait_ms / 1000,
            server.executor("model"),
        )
        server.watch(engine.start(), on_death=engine.fail_waiting)
        (warmup,) = encoder.tokenizer.tokenize([WARMUP_TEXT], "right")
        await engine.embed([warmup.ids], normalize=True)
        servicer.engine = engine
        model = encoder.model
        server.describe(
            ModelInfo(
                name=model.name,
                revision=str(model.path),
                sha256=artifact_digest(model.path),
                dtype="float32",
                engine=settings.backend,
                limits={"dimensions": str(model.dimensions), "max_tokens": str(model.max_tokens)},
            )
        )

    async def close() -> None:
        if hasattr(servicer, "engine"):  # not when a signal ended the warm-up
            await servicer.engine.close()
            if isinstance(servicer.engine.encoder.backend, TritonBackend):
                await servicer.engine.encoder.backend.model.close()

    server.add_warmup(load)
    server.add_shutdown(close)
