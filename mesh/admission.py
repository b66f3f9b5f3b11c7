"""Admission control: bounded concurrency, a bounded queue, and early refusal.

Each service owns one compute budget (the CPU/GPU semaphore). Past concurrency + queue a
call is refused at once with RESOURCE_EXHAUSTED and a RetryInfo, never left to pile up;
a call whose remaining deadline cannot cover its predicted queue wait (plus, for unary
calls, its predicted compute time) is refused before it takes a place in the queue.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge, Histogram

from mesh import deadline
from mesh.failures import Overloaded

IN_FLIGHT = Gauge("aimesh_admission_in_flight", "Calls holding a compute slot.", ["service"])
QUEUED = Gauge("aimesh_admission_queue_depth", "Calls waiting for a compute slot.", ["service"])
REJECTED = Counter(
    "aimesh_admission_rejected_total",
    "Calls refused by admission control, by reason.",
    ["service", "reason"],
)
QUEUE_WAIT = Histogram(
    "aimesh_admission_queue_wait_seconds",
    "Time calls waited for a compute slot.",
    ["service"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

_EWMA_WEIGHT = 0.2
# Predictions are only trusted after this many finished calls of a method.
_MIN_OBSERVATIONS = 5
_MIN_RETRY_S = 0.05
_MAX_RETRY_S = 30.0


class Admission:
    """The compute budget of one service: `max_concurrency` slots and `max_queue` waiters."""

    def __init__(self, service: str, *, max_concurrency: int, max_queue: int) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.service = service
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(max_concurrency)
        self._waiting = 0
        self._in_flight = 0
        self._hold_s: dict[str, float] = {}
        self._observations: dict[str, int] = {}
        self._in_flight_gauge = IN_FLIGHT.labels(service)
        self._queued_gauge = QUEUED.labels(service)
        self._queue_wait = QUEUE_WAIT.labels(service)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _mean_hold_s(self) -> float | None:
        known = [
            hold
            for method, hold in self._hold_s.items()
            if self._observations[method] >= _MIN_OBSERVATIONS
        ]
        return sum(known) / len(known) if known else None

    def retry_after_s(self) -> float:
        """When one slot is likely to free up: mean hold time spread over the slots."""
        hold = self._mean_hold_s()
        if hold is None:
            return 0.1
        return min(max(hold / self.max_concurrency, _MIN_RETRY_S), _MAX_RETRY_S)

    def _refuse(self, reason: str, message: str) -> Overloaded:
        REJECTED.labels(self.service, reason.lower()).inc()
        return Overloaded(message, retry_after_s=self.retry_after_s(), reason=reason)

    def _check_budget(self, method: str, *, streaming: bool) -> None:
        left = deadline.remaining()
        hold = self._mean_hold_s()
        if left is None or hold is None:
            return
        position = self._waiting + 1 if self._slots.locked() else 0
        predicted = position * hold / self.max_concurrency
        if not streaming and self._observations.get(method, 0) >= _MIN_OBSERVATIONS:
            predicted += self._hold_s[method]
        if left < predicted:
            raise self._refuse(
                "DEADLINE_TOO_SHORT",
                f"{self.service}: {left * 1000:.0f} ms left cannot cover the predicted "
                f"{predicted * 1000:.0f} ms of queueing and compute",
            )

    async def enter(self, method: str, *, streaming: bool) -> float:
        """Takes a slot, waiting in the queue if needed; returns the time spent queued."""
        queued = self._slots.locked()
        if queued and self._waiting >= self.max_queue:
            raise self._refuse(
                "QUEUE_FULL",
                f"{self.service} is at capacity ({self.max_concurrency} running, "
                f"{self._waiting} queued)",
            )
        self._check_budget(method, streaming=streaming)
        waited = 0.0
        if queued:
            started = time.monotonic()
            self._waiting += 1
            self._queued_gauge.set(self._waiting)
            try:
                await self._slots.acquire()
            finally:
                self._waiting -= 1
                self._queued_gauge.set(self._waiting)
            waited = time.monotonic() - started
        else:
            await self._slots.acquire()  # a free slot: returns without suspending
        self._in_flight += 1
        self._in_flight_gauge.set(self._in_flight)
        self._queue_wait.observe(waited)
        return waited

    def leave(self, method: str, held_s: float) -> None:
        self._in_flight -= 1
        self._in_flight_gauge.set(self._in_flight)
        self._slots.release()
        previous = self._hold_s.get(method)
        self._hold_s[method] = (
            held_s if previous is None else (_EWMA_WEIGHT * held_s + (1 - _EWMA_WEIGHT) * previous)
        )
        self._observations[method] = self._observations.get(method, 0) + 1
