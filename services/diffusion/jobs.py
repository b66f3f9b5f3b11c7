"""Diffusion jobs: ids, the compute slots and memory they wait for, and cancellation.

The mesh's own admission control (mesh/admission.py) queues whole calls before a handler
runs, so a caller cannot see its place in line. Diffusion needs what ComfyUI users ask
for instead: the stream opens at once, reports its queue position as it changes, and a
job only starts when a compute slot is free AND its estimated memory fits beside the
running jobs'. A job that could never fit is refused up front. Cancellation is per job:
an Event the worker checks between (step, image) units, so one job's cancel can never
touch another. A job belongs to the client it was submitted for (`x-aimesh-client`, the
edge key's tenant): another client's Cancel finds nothing.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field

from mesh.failures import Cancelled, OutOfMemory, Overloaded
from services.diffusion.engine import DiffusionModel, Plan
from services.diffusion.metrics import RESERVED, RUNNING, WAITING


@dataclass(eq=False)
class Job:
    model: DiffusionModel
    plan: Plan
    estimated_bytes: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    owner: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set by the worker once every unit is done: a cancel after that stops nothing, so
    # it must not say it did. The lock orders the two between the worker and the loop.
    _completed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled(f"job {self.id} was cancelled")

    def cancel(self) -> bool:
        """Asks the job to stop; True only if this call stopped work still to be done."""
        with self._lock:
            stops = not (self.cancelled.is_set() or self._completed)
            self.cancelled.set()
        return stops

    def complete(self) -> None:
        """The worker's last word: the job completed, unless a cancel got in first."""
        with self._lock:
            self.check_cancelled()
            self._completed = True


class JobQueue:
    """FIFO admission to `slots` concurrent jobs within `budget_bytes` of estimated memory."""

    def __init__(self, *, slots: int, budget_bytes: int, max_queue: int) -> None:
        self.slots = slots
        self.budget_bytes = budget_bytes
        self.max_queue = max_queue
        self._waiting: list[Job] = []
        self._running: set[Job] = set()
        self.reserved_bytes = 0
        self._changed = asyncio.Event()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _notify(self) -> None:
        """Wakes every waiter to look again; each waits on the Event current when it looked."""
        self._changed.set()
        self._changed = asyncio.Event()
        RUNNING.set(len(self._running))
        WAITING.set(len(self._waiting))
        RESERVED.set(self.reserved_bytes)

    def submit(self, job: Job) -> None:
        if job.estimated_bytes > self.budget_bytes:
            raise OutOfMemory(
                f"the job needs about {job.estimated_bytes / 2**20:.0f} MiB, more than this "
                f"worker's {self.budget_bytes / 2**20:.0f} MiB budget; use fewer images or a "
                "smaller size",
                retry_after_s=None,
                reason="JOB_TOO_LARGE",
            )
        if len(self._waiting) >= self.max_queue:
            raise Overloaded(
                f"{len(self._waiting)} diffusion jobs are queued already",
                retry_after_s=1.0,
                reason="QUEUE_FULL",
            )
        self._waiting.append(job)
        self._notify()

    def _try_start(self, job: Job) -> bool:
        fits = self.reserved_bytes + job.estimated_bytes <= self.budget_bytes
        if self._waiting[0] is not job or len(self._running) >= self.slots or not fits:
            return False
        self._waiting.pop(0)
        self._running.add(job)
        self.reserved_bytes += job.estimated_bytes
        self._notify()
        return True

    async def next_position(self, job: Job, last: int | None) -> int:
        """0 once `job` holds a slot; otherwise its 1-based place in line once it is not `last`.

        Raises Cancelled (and leaves the line) if the job is cancelled while it waits.
        """
        while True:
            changed = self._changed
            if job.cancelled.is_set():
                self.release(job)
                job.check_cancelled()
            if self._try_start(job):
                return 0
            position = self._waiting.index(job) + 1
            if position != last:
                return position
            await changed.wait()

    def release(self, job: Job) -> None:
        """Takes `job` out of the line, or frees the slot and memory it was admitted to.

        The owner calls it exactly when nothing runs for the job any more: when its worker
        has returned, or when the job ends before a worker was ever started for it (its
        caller left while waiting, or right as it was admitted). Idempotent.
        """
        if job in self._waiting:
            self._waiting.remove(job)
        elif job in self._running:
            self._running.remove(job)
            self.reserved_bytes -= job.estimated_bytes
        else:
            return
        self._notify()

    def job_ids(self) -> list[str]:
        return [job.id for job in (*self._waiting, *self._running)]

    def cancel(self, job_id: str, owner: str | None) -> bool:
        """Stops the waiting or running job `job_id` of `owner` (None: whoever's, as the
        service itself at shutdown); False if there is none, it was cancelled already or
        its work is all done. The running one stops at its next unit."""
        for job in (*self._waiting, *self._running):
            if job.id == job_id and owner in (None, job.owner):
                stopped = job.cancel()
                self._notify()
                return stopped
        return False
