"""Dynamic batching: requests arriving together share passes and each gets its own rows."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from services.embedder.encoder import Encoder
from services.embedder.engine import EmbedEngine
from services.embedder.settings import EmbedderSettings
from services.shared.minilm import normalized, pad
from tests.services.embedder.conftest import TEXTS, assert_same_vectors

pytestmark = pytest.mark.unit

SENTENCES = [f"request number {n} asks about topic {n * 7 % 13}" for n in range(16)]


class Observed:
    """The real backend, counting its passes. `gate` (when set) holds every pass until it
    opens, so a test can act while a batch is in the model thread; `fail` makes it raise."""

    def __init__(self, encoder: Encoder) -> None:
        self.backend = encoder.backend
        self.passes = 0
        self.started = threading.Event()
        self.gate: threading.Event | None = None
        self.fail: Exception | None = None

    def pool(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        self.passes += 1
        self.started.set()
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if self.fail is not None:
            raise self.fail
        return self.backend.pool(input_ids, attention_mask)


EngineFactory = Callable[..., tuple[EmbedEngine, Observed]]


@pytest.fixture
async def make_engine(onnx_encoder: Encoder) -> AsyncIterator[EngineFactory]:
    engines: list[EmbedEngine] = []
    model_thread = ThreadPoolExecutor(1)

    def make(max_batch_texts: int = 64, max_wait_s: float = 0.05) -> tuple[EmbedEngine, Observed]:
        observed = Observed(onnx_encoder)
        budget = EmbedderSettings().max_batch_tokens  # 256: 28 of SENTENCES (9 tokens) per pass
        encoder = Encoder(onnx_encoder.model, onnx_encoder.tokenizer, observed, budget)
        engines.append(EmbedEngine(encoder, max_batch_texts, max_wait_s, model_thread))
        engines[-1].start()
        return engines[-1], observed

    yield make
    for engine in engines:
        await engine.close()
    model_thread.shutdown()


def _rows(encoder: Encoder, texts: list[str]) -> list[list[int]]:
    return [t.ids for t in encoder.tokenizer.tokenize(texts, "right")]


def _alone(encoder: Encoder, row: list[int]) -> np.ndarray:
    return encoder.backend.pool(*pad([row]))[0]


async def test_concurrent_requests_share_passes_and_get_their_own_rows(
    make_engine: EngineFactory, onnx_encoder: Encoder
):
    engine, observed = make_engine()
    rows = _rows(onnx_encoder, SENTENCES)
    results = await asyncio.gather(*(engine.embed([row], normalize=False) for row in rows))
    assert observed.passes <= 2  # 16 requests, not 16 passes
    for row, result in zip(rows, results, strict=True):
        assert result.vectors.shape == (1, 384)
        assert_same_vectors(result.vectors, [_alone(onnx_encoder, row)], tolerance=1e-5)
        assert result.queue_s >= 0 and result.inference_s > 0


async def test_a_request_of_many_texts_keeps_its_order_and_normalizes(
    make_engine: EngineFactory, onnx_encoder: Encoder
):
    engine, _ = make_engine()
    rows = _rows(onnx_encoder, TEXTS)
    other = engine.embed(_rows(onnx_encoder, ["a neighbour in the same batch"]), normalize=True)
    mine, _ = await asyncio.gather(engine.embed(rows, normalize=True), other)
    expected = normalized(np.stack([_alone(onnx_encoder, row) for row in rows]))
    assert_same_vectors(mine.vectors, expected, tolerance=1e-5)
    np.testing.assert_allclose(np.linalg.norm(mine.vectors, axis=1), 1.0, atol=1e-6)


async def test_a_batch_stops_gathering_at_max_batch_texts(
    make_engine: EngineFactory, onnx_encoder: Encoder
):
    engine, observed = make_engine(max_batch_texts=4, max_wait_s=0.5)
    rows = _rows(onnx_encoder, SENTENCES[:8])
    await asyncio.wait_for(
        asyncio.gather(*(engine.embed([row], normalize=True) for row in rows)), timeout=5
    )
    assert observed.passes == 2  # two full batches, no waiting out the 0.5 s window


async def test_cancelling_one_request_does_not_fail_its_batch(
    make_engine: EngineFactory, onnx_encoder: Encoder
):
    engine, observed = make_engine(max_wait_s=0.01)
    rows = _rows(onnx_encoder, SENTENCES[:6])
    observed.gate = threading.Event()
    running = [asyncio.create_task(engine.embed([row], normalize=True)) for row in rows[:3]]
    await asyncio.to_thread(observed.started.wait, 5)  # the first batch is in the model
    queued = [asyncio.create_task(engine.embed([row], normalize=True)) for row in rows[3:]]
    await asyncio.sleep(0)
    running[1].cancel()  # its rows are being computed
    queued[1].cancel()  # still waiting for the next batch
    observed.gate.set()
    done = await asyncio.gather(*running, *queued, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    assert isinstance(done[4], asyncio.CancelledError)
    for index in (0, 2, 3, 5):
        expected = normalized(_alone(onnx_encoder, rows[index])[None])
        assert_same_vectors(done[index].vectors, expected, tolerance=1e-5)


async def test_a_failed_pass_fails_its_batch_and_the_engine_keeps_serving(
    make_engine: EngineFactory, onnx_encoder: Encoder
):
    engine, observed = make_engine()
    rows = _rows(onnx_encoder, SENTENCES[:2])
    observed.fail = RuntimeError("the backend broke")
    failed = await asyncio.gather(
        *(engine.embed([row], normalize=True) for row in rows), return_exceptions=True
    )
    assert [str(error) for error in failed] == ["the backend broke"] * 2
    observed.fail = None
    result = await engine.embed([rows[0]], normalize=False)
    assert_same_vectors(result.vectors, [_alone(onnx_encoder, rows[0])], tolerance=1e-5)
