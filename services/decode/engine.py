"""Continuous batching: sequences join and leave a running batch at step boundaries and
one forward pass serves every running sequence.

The scheduler runs on the event loop and only touches Python state between steps; every
tensor operation (inserting a pulled KV into a slot, compacting slots, the forward pass,
sampling) runs inside one call on the model thread, so the cache never sees two writers.
A sequence cancelled by its caller is dropped at the next boundary: its slot is free
again within one step.

A constrained sequence (services.llm.guide) samples under a mask of the tokens that may
come next. The masks of a step depend only on tokens already sampled, so where the
forward pass runs on a GPU a second thread computes them meanwhile (llguidance releases
the GIL). On a CPU the forward pass holds every core: a second thread there slowed each
step by more than the masks cost (docs/benchmarks.md), so they are computed after it,
~50 µs a constrained row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mesh.failures import InvalidInput, NotReady, OutOfMemory
from services.llm import metrics
from services.llm.guide import Guide
from services.llm.kv_codec import KvState
from services.llm.llama import LlamaConfig
from services.llm.sampling import Draw, SamplingParams, sample
from services.llm.stopping import Finish, StopChecker
from services.shared.memory import is_out_of_memory

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # reporting unit for GetLoad's kv_blocks, as vLLM counts its cache


class Slots(Protocol):
    """An engine's decode slots (services.llm.llama.TorchSlots, services.llm.llama_cpp.LlamaCpp):
    one `decode` steps every running sequence, each in its own slot.

    `compacted`: running sequences must sit in slots 0..n-1 (the torch cache attends over
    plain views of its first n slots), so a leaving sequence's slot is refilled by moving
    the ones above it down. Otherwise a sequence keeps its slot until it leaves.
    `forward_on_gpu`: the forward pass leaves the CPU's cores free, so the masks of
    constrained rows are computed beside it.
    """

    config: LlamaConfig
    compacted: bool
    forward_on_gpu: bool

    def readable(self, kv: KvState) -> KvState:
        """`kv` as `load` reads it fastest; any thread may call it, so that work such as
        llama.cpp writing torch KV as its state runs before the sequence joins, not in a
        step that every running sequence waits for."""
        ...

    def load(self, slot: int, kv: KvState) -> None: ...

    def move(self, source: int, target: int, length: int) -> None: ...

    def free(self, slot: int) -> None: ...

    def decode(
        self, token_ids: list[int], positions: list[int], slots: list[int]
    ) -> torch.Tensor: ...


@dataclass
class Emission:
    """What the scheduler hands a sequence's stream after a step."""

    tokens: list[int]
    logprobs: list[float]
    finish: Finish | None = None
    # Each token's most likely alternatives, when the request asked for them.
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    error: BaseException | None = None


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    kv: KvState | None
    first_token: int
    params: SamplingParams
    stop: StopChecker
    # The constraint's matcher, past first_token already; None: unconstrained.
    guide: Guide | None = None
    history: list[int] = field(default_factory=list)
    outbox: asyncio.Queue[Emission] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    submitted_at: float = 0.0
    joined_at: float | None = None
    slot: int = -1

    def __post_init__(self) -> None:
        self.history = [*self.prompt, self.first_token]

    @property
    def position(self) -> int:
        """Where the last sampled token will sit in the cache."""
        return len(self.history) - 1

    @property
    def done(self) -> bool:
        return self.cancelled or self.stop.finish is not None


def _masks(guided: list[Sequence]) -> dict[Sequence, torch.Tensor | Exception]:
    """Guide thread: each constrained sequence's mask for the coming step, or why it has
    none (that sequence alone fails)."""
    masks: dict[Sequence, torch.Tensor | Exception] = {}
    for sequence in guided:
        assert sequence.guide is not None
        try:
            masks[sequence] = sequence.guide.allowed()
        except Exception as error:
            masks[sequence] = error
    return masks


@dataclass
class _Plan:
    """Work for one model-thread call: drops, joins, then a step over `running`.

    The model thread fills in the outcome: which sequences stepped and what each sampled,
    and which failed alone (a KV that would not load, a row that would not sample, the
    sequence evicted to make an out-of-memory step fit), so one request's failure is
    that request's alone and its neighbours keep streaming.
    """

    keep: list[Sequence]
    joins: list[Sequence]
    stepped: list[tuple[Sequence, Draw]] = field(default_factory=list)
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)


class DecodeEngine:
    def __init__(self, slots: Slots, max_batch_size: int, max_seq_len: int) -> None:
        self.slots = slots
        self.config = slots.config
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self._occupied: set[int] = set()  # slots that may hold a sequence's KV
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.steps = 0
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="decode-model")
        self.guide_thread = ThreadPoolExecutor(1, thread_name_prefix="decode-guide")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- called from servicers (event loop) ----

    def start(self) -> asyncio.Task[None]:
        """Starts the scheduler; the caller watches the task (a scheduler that died must
        not leave the worker looking healthy with every stream hanging)."""
        self._task = asyncio.create_task(self._run(), name="decode-scheduler")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.model_thread.shutdown(wait=False, cancel_futures=True)
        self.guide_thread.shutdown(wait=False, cancel_futures=True)

    def submit(self, sequence: Sequence) -> None:
        if self._task is None or self._task.done():
            raise NotReady("the decode scheduler is not running")
        sequence.submitted_at = time.perf_counter()
        self.waiting.append(sequence)
        self._wake.set()

    def cancel(self, sequence: Sequence) -> None:
        """Called when the caller is gone; the slot is freed at the next step boundary."""
        sequence.cancelled = True
        if sequence in self.waiting:
            self.waiting.remove(sequence)
            sequence.kv = None
        self._wake.set()

    def fail_all(self, error: BaseException) -> None:
        """Ends every running and waiting sequence with `error` (the scheduler is gone)."""
        for sequence in [*self.running, *self.waiting]:
            self._fail_one(sequence, error)
        self.running = []
        self.waiting.clear()

    @property
    def used_positions(self) -> int:
        return sum(s.position + 1 for s in self.running)

    # ---- the scheduler ----

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            keep = [s for s in self.running if not s.done]
            joins = []
            while self.waiting and len(keep) + len(joins) < self.max_batch_size:
                joins.append(self.waiting.popleft())
            if not keep and not joins:
                if self.running:  # the last sequences left: compact to empty
                    self.running = []
                    self._report()
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = _Plan(keep, joins)
            # A joining sequence's wait ends as its first step starts, not after it ran.
            scheduled = time.perf_counter()
            try:
                await loop.run_in_executor(self.model_thread, self._step, plan)
            except Exception as error:  # a step failed for every row alike: fail the batch
                log.exception("decode step failed", exc_info=error)
                plan.stepped = []
                plan.failed = [(s, error) for s in plan.keep + plan.joins]
            for sequence, error in plan.failed:
                self._fail_one(sequence, error)
            self.running = [sequence for sequence, _ in plan.stepped]
            self.steps += 1
            for sequence in plan.joins:
                sequence.joined_at = scheduled
                metrics.REQUEST_QUEUE_TIME.observe(scheduled - sequence.submitted_at)
            self._report()
            for sequence, draw in plan.stepped:
                self._deliver(sequence, draw)
            await asyncio.sleep(0)  # let streams send before the next step

    def _report(self) -> None:
        metrics.NUM_REQUESTS_RUNNING.set(len(self.running))
        metrics.NUM_REQUESTS_WAITING.set(len(self.waiting))
        metrics.KV_CACHE_USAGE.set(self.used_positions / (self.max_batch_size * self.max_seq_len))

    def _compact(self, batch: list[Sequence]) -> None:
        """Moves each sequence's KV down to its index in `batch` (slot order is kept), for
        slots that must be compacted."""
        if not self.slots.compacted:
            return
        for slot, sequence in enumerate(batch):
            if sequence.slot != slot:
                self.slots.move(sequence.slot, slot, sequence.position)
                sequence.slot = slot

    def _step(self, plan: _Plan) -> None:
        """Model thread: compact the kept sequences, load the joining ones into the lowest
        free slots, run one step, free the slots of sequences that left."""
        batch = list(plan.keep)
        self._compact(batch)
        taken = {sequence.slot for sequence in batch}
        for sequence in plan.joins:
            assert sequence.kv is not None
            slot = min(set(range(self.max_batch_size)) - taken)
            self._occupied.add(slot)
            try:
                self.slots.load(slot, sequence.kv)
            except Exception as error:
                plan.failed.append((sequence, self._own_failure(error, "loading its KV")))
                continue
            finally:
                sequence.kv = None
            sequence.slot = slot
            taken.add(slot)
            batch.append(sequence)
        guided = [sequence for sequence in batch if sequence.guide is not None]
        beside = bool(guided) and self.slots.forward_on_gpu
        masking = self.guide_thread.submit(_masks, guided) if beside else None
        logits = self._forward(batch, plan)
        masks = masking.result() if masking is not None else _masks(guided)
        for slot in self._occupied - {sequence.slot for sequence in batch}:
            self.slots.free(slot)
        self._occupied = {sequence.slot for sequence in batch}
        for row, sequence in zip(logits, batch, strict=True):
            index = len(sequence.history) - len(sequence.prompt)
            try:
                allowed = masks.get(sequence)
                if isinstance(allowed, Exception):
                    raise allowed
                draw = sample(row, sequence.params, sequence.history, index=index, allowed=allowed)
                if sequence.guide is not None:
                    sequence.guide.advance(draw.token)
            except Exception as error:
                plan.failed.append((sequence, self._own_failure(error, "sampling")))
                continue
            plan.stepped.append((sequence, draw))

    def _forward(self, batch: list[Sequence], plan: _Plan) -> torch.Tensor:
        """One decode step over `batch`; out of memory, the longest sequence leaves (its
        caller may retry) and the step runs again for the rest. Shrinks `batch` in place."""
        while batch:
            try:
                return self.slots.decode(
                    [s.history[-1] for s in batch],
                    [s.position for s in batch],
                    [s.slot for s in batch],
                )
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                evicted = max(batch, key=lambda s: s.position)
                batch.remove(evicted)
                plan.failed.append(
                    (evicted, OutOfMemory(f"decode ran out of memory for this sequence: {error}"))
                )
                self._compact(batch)
        return torch.empty(0)

    @staticmethod
    def _own_failure(error: Exception, doing: str) -> BaseException:
        if is_out_of_memory(error):
            return OutOfMemory(f"decode ran out of memory {doing}: {error}")
        if isinstance(error, InvalidInput):  # the request's (its constraint), not a fault
            log.info("one sequence's request failed %s: %s", doing, error)
            return error
        log.exception("one sequence failed %s; the rest of the batch goes on", doing)
        return error

    def _deliver(self, sequence: Sequence, draw: Draw) -> None:
        if sequence.cancelled:
            return
        sequence.history.append(draw.token)
        room_left = sequence.position + 1 < self.max_seq_len
        tokens = sequence.stop.feed(draw.token, room_left=room_left)
        if tokens or sequence.stop.finish is not None:
            top = [draw.top] if tokens and sequence.params.top_logprobs else []
            sequence.outbox.put_nowait(
                Emission(tokens, [draw.logprob] * len(tokens), sequence.stop.finish, top=top)
            )

    @staticmethod
    def _fail_one(sequence: Sequence, error: BaseException) -> None:
        sequence.cancelled = True
        sequence.kv = None
        sequence.outbox.put_nowait(Emission([], [], error=error))

    # ---- warm-up ----

    def warm_up(self) -> None:
        """Model thread: one real step in slot 0, so the first request pays no first-call cost."""
        self.slots.decode([0], [0], [0])
        self.slots.free(0)
