"""Runs with an id: each runs in a task of its own, apart from the call that started it,
so another call can follow it (Attach, from any event on), stop it (Cancel) or ask how it
stands (GetRun).

An event is numbered, stored (services/agent/run_store.py) and only then handed to the
run's followers, so what a follower has seen is always in the store: re-attaching after a
dropped stream, here or on another replica that shares the store, misses nothing and
repeats nothing. A run on another replica is followed by polling the store; a Cancel for
it is a flag in the store that its replica reads with its next event, and polls for.

Each run is held by its replica under a lease it renews. When a replica dies (kill -9,
a lost pod), its leases run out and another replica claims the runs (`upkeep`) and goes
on with each from its last checkpoint (`resume`, the servicer's): its events keep their
numbers, so a client re-attached from its last seq gets every event once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aimesh.agent.v1 import agent_pb2
from mesh.failures import NotFound, Overloaded
from services.agent.run_store import RUNNING, Lease, Orphan, RunRecord, RunStore

log = logging.getLogger(__name__)

# How long a Cancel for a run on another replica waits to see it end.
CANCEL_WAIT_S = 5.0


@dataclass(eq=False)
class LiveRun:
    """A run in this process: its events so far (seq n at index n - 1) and its end."""

    run_id: str
    client: str
    events: list[agent_pb2.RunResponse] = field(default_factory=list)
    state: int = RUNNING
    # What ended it, when it failed: the Run call that started it raises it.
    error: BaseException | None = None
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def publish(self, event: agent_pb2.RunResponse, state: int) -> None:
        self.events.append(event)
        self.state = state
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, after_seq: int) -> AsyncIterator[agent_pb2.RunResponse]:
        """Every event after `after_seq`, as it comes, to the run's end."""
        sent = after_seq
        while True:
            changed = self._changed
            while sent < len(self.events):
                sent += 1
                yield self.events[sent - 1]
            if not self.running or (self.task is not None and self.task.done()):
                return
            await changed.wait()

    async def stop(self) -> None:
        """Cancels the run and waits for it to record how it ended."""
        if self.task is not None and not self.task.done():
            if self.running:
                self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


Execute = Callable[[LiveRun], Awaitable[None]]
Resume = Callable[[Orphan], Awaitable[None]]


class Runs:
    def __init__(self, store: RunStore, max_live: int, poll_s: float, lease_s: float) -> None:
        self.store = store
        self.max_live = max_live
        self.poll_s = poll_s
        self.lease = Lease(uuid.uuid4().hex, lease_s)
        self.live: dict[str, LiveRun] = {}

    def _room(self) -> int:
        return self.max_live - len(self.live)

    async def start(self, request: agent_pb2.RunRequest, client: str, execute: Execute) -> LiveRun:
        """A new run, recorded under this replica's lease, running `execute` in a task
        of its own."""
        if self._room() <= 0:
            raise Overloaded(
                f"{len(self.live)} runs are in progress here, the most this agent runs",
                retry_after_s=1.0,
            )
        run = LiveRun(uuid.uuid4().hex, client)
        await asyncio.to_thread(self.store.create, request, run.run_id, client, self.lease)
        self._launch(run, execute)
        return run

    def _launch(self, run: LiveRun, execute: Execute) -> None:
        self.live[run.run_id] = run
        run.task = asyncio.create_task(execute(run), name="agent-run")
        run.task.add_done_callback(lambda _: self.live.pop(run.run_id, None))

    async def adopt(self, orphan: Orphan, execute: Execute) -> LiveRun:
        """A claimed run, here now: its stored events first, so numbering goes on."""
        run = LiveRun(orphan.run_id, orphan.client)
        run.events = await asyncio.to_thread(self._all_events, orphan.run_id)
        self._launch(run, execute)
        return run

    def _all_events(self, run_id: str) -> list[agent_pb2.RunResponse]:
        events: list[agent_pb2.RunResponse] = []
        while page := self.store.events(run_id, len(events)):
            events += page
        return events

    async def emit(
        self,
        run: LiveRun,
        event: agent_pb2.RunResponse,
        state: int = RUNNING,
        checkpoint: bytes | None = None,
    ) -> None:
        """Numbers, stores (with the loop's state after it, when given) and publishes
        one event; a Cancel made on another replica cancels this run here, at this step."""
        event.run_id, event.seq = run.run_id, len(run.events) + 1
        write = asyncio.ensure_future(
            asyncio.to_thread(self.store.append, event, state, checkpoint)
        )
        try:
            cancel_asked = await asyncio.shield(write)
        except asyncio.CancelledError:
            # Stored either way: published too, so the next event's seq follows it.
            await write
            run.publish(event, state)
            raise
        run.publish(event, state)
        if cancel_asked and state == RUNNING and run.task is asyncio.current_task():
            run.task.cancel()

    async def record(self, run_id: str, client: str) -> RunRecord:
        found = await asyncio.to_thread(self.store.get, run_id, client)
        if found is None:
            raise NotFound(f"no run {run_id!r}", resource_type="run", resource_name=run_id)
        return found

    def _here(self, run_id: str, client: str) -> LiveRun | None:
        run = self.live.get(run_id)
        return run if run is not None and run.client == client else None

    async def follow(
        self, run_id: str, client: str, after_seq: int
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        """The run's events after `after_seq` to its end: from this process while it
        runs here, else from the store (polled while another replica runs it)."""
        record = await self.record(run_id, client)
        sent = after_seq
        while True:
            here = self._here(run_id, client)
            if here is not None:
                async for event in here.follow(sent):
                    yield event
                return
            events = await asyncio.to_thread(self.store.events, run_id, sent)
            for event in events:
                sent = event.seq
                yield event
            if events:
                continue
            if record.ended:
                return
            await asyncio.sleep(self.poll_s)
            record = await self.record(run_id, client)

    async def cancel(self, run_id: str, client: str) -> int:
        """Stops the run; its state once stopped (or how it had ended)."""
        here = self._here(run_id, client)
        if here is not None:
            await here.stop()
            return here.state
        record = await self.record(run_id, client)
        if record.ended:
            return record.state
        await asyncio.to_thread(self.store.request_cancel, run_id)
        deadline = asyncio.get_running_loop().time() + CANCEL_WAIT_S
        while not record.ended and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.poll_s)
            record = await self.record(run_id, client)
        return record.state

    async def upkeep(self, resume: Resume) -> None:
        """Every poll: stops the runs here that a Cancel on another replica asked to stop
        (even one waiting on a tool that sends nothing), renews this replica's leases,
        and takes over runs whose replica stopped renewing (a background task; the
        server watches it)."""
        clock = asyncio.get_running_loop().time
        leases_due = clock()
        while True:
            await asyncio.sleep(self.poll_s)
            here = list(self.live)
            asked = await asyncio.to_thread(self.store.cancels_asked, here)
            for run_id in asked:
                run = self.live.get(run_id)
                if run is not None and run.task is not None and run.running:
                    run.task.cancel()
            if clock() < leases_due:
                continue
            # A few renewals per lease: one late renewal does not lose a run.
            leases_due = clock() + self.lease.seconds / 4
            await asyncio.to_thread(self.store.renew, self.lease, here)
            if self._room() > 0:
                for orphan in await asyncio.to_thread(
                    self.store.claim_orphans, self.lease, self._room()
                ):
                    log.warning(
                        "resuming a run whose replica stopped renewing its lease",
                        extra={"run_id": orphan.run_id, "events": orphan.events},
                    )
                    await resume(orphan)

    async def close(self) -> None:
        """Stops every run here (the process is shutting down)."""
        await asyncio.gather(*(run.stop() for run in list(self.live.values())))
