"""Dynamic batching: requests that arrive together share forward passes.

A request's tokenized inputs wait in an asyncio queue. The batching loop takes the first
waiting request, then gathers more until max_batch_texts texts or until max_wait_s after
it began gathering, whichever comes first, and hands them all to the model thread at once
(`Encoder.embed` sorts them by length into passes). Each request gets exactly its own
rows back. A request cancelled while it waits is dropped from its batch; one cancelled
while its batch runs just never reads its rows: either way the others are unaffected.
All local model work happens in one thread, so the backend never runs two passes at once.
On Triton a batch runs within the longest budget among its requests, and is cancelled
when every one of them is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Histogram

from mesh import deadline
from mesh.failures import NotReady
from services.embedder.encoder import Encoder
from services.shared.minilm import normalized

log = logging.getLogger(__name__)

# TEI's te_batch_next_size: how well requests share forward passes.
BATCH_TEXTS = Histogram(
    "aimesh_embedder_batch_texts",
    "Texts per micro-batch (one call into the model thread).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)


@dataclass(frozen=True)
class Embedded:
    """One request's vectors, and where its time went."""

    vectors: np.ndarray  # [inputs, dimensions], float32
    queue_s: float  # from submission to the start of its batch's forward passes
    inference_s: float  # its batch's forward passes, shared with the batch's other requests


@dataclass(eq=False)
class _Request:
    rows: Sequence[Sequence[int]]
    submitted_at: float
    expires_at: float | None  # time.monotonic() when the caller's deadline passes
    answer: asyncio.Future[tuple[np.ndarray, float, float]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class EmbedEngine:
    def __init__(
        self, encoder: Encoder, max_batch_texts: int, max_wait_s: float, model_thread: Executor
    ) -> None:
        self.encoder = encoder
        self.max_batch_texts = max_batch_texts
        self.max_wait_s = max_wait_s
        self.model_thread = model_thread  # one thread: passes run one at a time
        self._waiting: asyncio.Queue[_Request] = asyncio.Queue()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Starts the batching loop; the caller watches the task, since requests wait on
        it and a loop that died would leave each of them hanging until its deadline."""
        self._loop_task = asyncio.create_task(self._batching_loop(), name="embedder-batches")
        return self._loop_task

    def fail_waiting(self, error: BaseException) -> None:
        """Ends every request still queued with `error` (the batching loop is gone)."""
        while not self._waiting.empty():
            request = self._waiting.get_nowait()
            if not request.answer.done():
                request.answer.set_exception(error)

    async def embed(self, rows: Sequence[Sequence[int]], normalize: bool) -> Embedded:
        """Vectors of tokenized rows (ids within the model's maximum), in their order."""
        if self._loop_task is None or self._loop_task.done():
            raise NotReady("the embedder's batching loop is not running")
        left = deadline.remaining()
        request = _Request(
            rows, time.perf_counter(), None if left is None else time.monotonic() + left
        )
        self._waiting.put_nowait(request)
        # Cancelling the caller cancels `answer` too, which marks the request as dropped.
        vectors, started_at, inference_s = await request.answer
        return Embedded(
            normalized(vectors) if normalize else vectors,
            queue_s=started_at - request.submitted_at,
            inference_s=inference_s,
        )

    async def close(self) -> None:
        """Stops the batching loop; requests still waiting fail as cancelled."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        while not self._waiting.empty():
            self._waiting.get_nowait().answer.cancel()

    async def _batching_loop(self) -> None:
        while True:
            batch = await self._gather()
            if batch:
                await self._run(batch)

    async def _gather(self) -> list[_Request]:
        """The next batch: what arrives within max_wait_s of the first, up to the limit."""
        batch = [await self._waiting.get()]
        texts = len(batch[0].rows)
        until = time.perf_counter() + self.max_wait_s
        while texts < self.max_batch_texts:
            if self._waiting.empty():
                left = until - time.perf_counter()
                if left <= 0:
                    break
                try:
                    request = await asyncio.wait_for(self._waiting.get(), left)
                except TimeoutError:
                    break
            else:
                request = self._waiting.get_nowait()
            batch.append(request)
            texts += len(request.rows)
        return [request for request in batch if not request.answer.done()]

    async def _run(self, batch: list[_Request]) -> None:
        rows = [row for request in batch for row in request.rows]
        BATCH_TEXTS.observe(len(rows))
        started_at = time.perf_counter()
        try:
            if self.encoder.remote:
                vectors = await self._remote(batch, rows)
                if vectors is None:  # every request of the batch was cancelled
                    return
            else:
                vectors = await asyncio.get_running_loop().run_in_executor(
                    self.model_thread, self.encoder.embed, rows
                )
        except asyncio.CancelledError:  # the engine is closing
            for request in batch:
                request.answer.cancel()
            raise
        except Exception as error:  # every request of the batch shares the failure
            log.exception("embedding a batch failed", extra={"texts": len(rows)})
            for request in batch:
                if not request.answer.done():
                    request.answer.set_exception(error)
            return
        inference_s = time.perf_counter() - started_at
        start = 0
        for request in batch:
            stop = start + len(request.rows)
            if not request.answer.done():  # cancelled while the batch ran
                request.answer.set_result((vectors[start:stop], started_at, inference_s))
            start = stop

    async def _remote(self, batch: list[_Request], rows: list[Sequence[int]]) -> np.ndarray | None:
        """The batch's passes on Triton; None once every request of the batch is cancelled
        (the passes are cancelled with them)."""
        deadlines = [request.expires_at for request in batch]
        left = None if None in deadlines else max(deadlines) - time.monotonic()

        async def within_budget() -> np.ndarray:
            if left is None:
                return await self.encoder.embed_remote(rows)
            with deadline.budget(left):
                return await self.encoder.embed_remote(rows)

        work = asyncio.create_task(within_budget())
        all_dropped = asyncio.ensure_future(asyncio.wait([r.answer for r in batch]))
        try:
            await asyncio.wait({work, all_dropped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            all_dropped.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        return None if work.cancelled() else work.result()
