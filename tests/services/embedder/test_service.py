"""EmbedderService over real gRPC on 127.0.0.1, checked against sentence-transformers.

One server serves the whole module. It may run 32 calls at once (its ServiceSpec's slots,
set here too: the test depends on them), so that the concurrent callers below reach the
batching engine together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio
from sentence_transformers import SentenceTransformer

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.config import MeshSettings, ServiceSettings
from mesh.errors import field_violations
from mesh.failures import FieldViolation
from services.embedder.servicer import MAX_INPUT_BYTES, SERVICE
from tests.conftest import metric
from tests.harness import InProcess
from tests.services.embedder.conftest import TEXTS, assert_same_vectors

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

LONG = TEXTS[-1]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(mesh_settings: MeshSettings) -> AsyncIterator[embedder_pb2_grpc.EmbedderServiceStub]:
    settings = mesh_settings.model_copy(
        update={"services": {"embedder": ServiceSettings(max_concurrency=32)}}
    )
    async with InProcess() as services:
        served = await services.start("embedder", settings)
        channel = services.channel(served.target, SERVICE, settings=settings)
        yield embedder_pb2_grpc.EmbedderServiceStub(channel)


async def _embed(
    stub, inputs: list[str], **fields
) -> tuple[np.ndarray, embedder_pb2.EmbedResponse]:
    response = await stub.Embed(embedder_pb2.EmbedRequest(inputs=inputs, **fields), timeout=10)
    return np.array([e.values for e in response.embeddings], dtype=np.float32), response


async def _violations(stub, **fields) -> list[FieldViolation]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(embedder_pb2.EmbedRequest(**fields), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(caught.value)


async def test_vectors_match_sentence_transformers(stub, sentence_transformer: SentenceTransformer):
    vectors, response = await _embed(stub, TEXTS, truncate=True)
    assert_same_vectors(vectors, sentence_transformer.encode(TEXTS))
    assert response.dimensions == 384
    assert response.model == "sentence-transformers/all-MiniLM-L6-v2"
    tokens = sentence_transformer.tokenizer(TEXTS, truncation=True, max_length=256)["input_ids"]
    assert response.usage.prompt_tokens == sum(map(len, tokens))
    assert response.usage.total_tokens == response.usage.prompt_tokens
    assert response.usage.completion_tokens == 0
    assert [s.name for s in response.timing.stages] == ["tokenize", "queue", "inference"]
    assert response.timing.total_ns >= sum(s.duration_ns for s in response.timing.stages)


async def test_normalize_is_on_unless_asked_off(stub):
    default, _ = await _embed(stub, TEXTS[:3])
    on, _ = await _embed(stub, TEXTS[:3], normalize=True)
    off, _ = await _embed(stub, TEXTS[:3], normalize=False)
    np.testing.assert_allclose(np.linalg.norm(default, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(default, on)
    norms = np.linalg.norm(off, axis=1)
    assert (np.abs(norms - 1.0) > 0.1).all()  # MiniLM's mean-pooled vectors are not unit
    assert_same_vectors(off / norms[:, None], default, tolerance=1e-6)


async def test_an_input_over_256_tokens_fails_without_truncate(
    stub, sentence_transformer: SentenceTransformer
):
    tokens = len(sentence_transformer.tokenizer(LONG)["input_ids"])
    assert await _violations(stub, inputs=["short", LONG]) == [
        FieldViolation(
            "inputs[1]",
            f"is {tokens} tokens, over the model's maximum of 256; set truncate to cut it",
        )
    ]


@pytest.mark.parametrize(
    ("direction", "side"),
    [
        (embedder_pb2.TRUNCATION_DIRECTION_UNSPECIFIED, "right"),
        (embedder_pb2.TRUNCATION_DIRECTION_RIGHT, "right"),
        (embedder_pb2.TRUNCATION_DIRECTION_LEFT, "left"),
    ],
)
async def test_truncate_cuts_the_side_asked_for(
    stub, sentence_transformer: SentenceTransformer, direction: int, side: str
):
    vectors, response = await _embed(
        stub, [LONG, "short"], truncate=True, truncation_direction=direction
    )
    assert response.usage.prompt_tokens == 256 + 3
    sentence_transformer.tokenizer.truncation_side = side  # what it cuts, it cuts this side
    try:
        expected = sentence_transformer.encode([LONG, "short"])
    finally:
        sentence_transformer.tokenizer.truncation_side = "right"
    assert_same_vectors(vectors, expected)


async def test_left_and_right_cuts_differ(stub):
    right, _ = await _embed(stub, [LONG], truncate=True)
    left, _ = await _embed(
        stub, [LONG], truncate=True, truncation_direction=embedder_pb2.TRUNCATION_DIRECTION_LEFT
    )
    assert float(right[0] @ left[0]) < 0.99


async def test_concurrent_callers_share_batches_and_get_their_own_vectors(stub):
    texts = [f"caller {n} wants the vector of sentence {n}" for n in range(16)]
    alone = [(await _embed(stub, [text]))[0] for text in texts]
    batches = metric("aimesh_embedder_batch_texts_count")
    together = await asyncio.gather(*(_embed(stub, [text]) for text in texts))
    assert metric("aimesh_embedder_batch_texts_count") - batches <= 4
    for single, (vectors, _) in zip(alone, together, strict=True):
        assert_same_vectors(vectors, single, tolerance=1e-5)


async def test_no_inputs(stub):
    assert await _violations(stub, inputs=[]) == [
        FieldViolation("inputs", "must hold at least one text")
    ]


async def test_more_than_32_inputs(stub):
    assert await _violations(stub, inputs=["text"] * 33) == [
        FieldViolation("inputs", "must hold at most 32 texts, got 33")
    ]


async def test_every_bad_input_is_reported(stub):
    too_big = "é" * (MAX_INPUT_BYTES // 2 + 1)  # fewer characters than bytes: bytes count
    assert await _violations(stub, inputs=["fine", "", too_big, ""]) == [
        FieldViolation("inputs[1]", "must not be empty"),
        FieldViolation("inputs[2]", f"must be at most {MAX_INPUT_BYTES} bytes of UTF-8, got 65538"),
        FieldViolation("inputs[3]", "must not be empty"),
    ]


async def test_unknown_truncation_direction(stub):
    assert await _violations(stub, inputs=["text"], truncate=True, truncation_direction=7) == [
        FieldViolation(
            "truncation_direction",
            "must be one of TRUNCATION_DIRECTION_UNSPECIFIED, TRUNCATION_DIRECTION_RIGHT,"
            " TRUNCATION_DIRECTION_LEFT, got 7",
        )
    ]


async def test_an_input_of_64_kib_is_accepted_and_cut(stub):
    text = "word " * (MAX_INPUT_BYTES // 5)
    vectors, response = await _embed(stub, [text], truncate=True)
    assert vectors.shape == (1, 384)
    assert response.usage.prompt_tokens == 256
