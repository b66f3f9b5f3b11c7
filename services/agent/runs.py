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
from typing import TypeVar

from aimesh.agent.v1 import agent_pb2
from mesh.failures import NotFound, NotReady, Overloaded
from mesh.store_health import StoreHealth
from services.agent.run_store import RUNNING, Lease, LeaseLost, Orphan, RunRecord, RunStore

log = logging.getLogger(__name__)

# How long a Cancel for a run on another replica waits to see it end.
CANCEL_WAIT_S = 5.0
# The run store's state while its calls fail (aimesh_store_state{store="run_store"}).
FAILING = "failing"
T = TypeVar("T")


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
    # Until when (the event loop's clock) this replica surely holds the run's lease.
    held_until: float = 0.0
    # Whether it stopped here because this replica no longer holds it (Runs._lose).
    lost: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def publish(self, event: agent_pb2.RunResponse, state: int) -> None:
        self.events.append(event)
        self.state = state
        self.wake()

    def wake(self) -> None:
        """Lets every follower look again (an event, or the run's task ended)."""
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
    def __init__(
        self,
        store: RunStore,
        max_live: int,
        poll_s: float,
        lease_s: float,
        health: StoreHealth | None = None,
    ) -> None:
        self.store = store
        self.max_live = max_live
        self.poll_s = poll_s
        self.lease = Lease(uuid.uuid4().hex, lease_s)
        self.live: dict[str, LiveRun] = {}
        self.health = health or StoreHealth("run_store")

    def _room(self) -> int:
        return self.max_live - len(self.live)

    async def stored(self, call: Callable[..., T], *args: object, write: bool = False) -> T:
        """A store call in a worker thread. The store's own failure (it did not answer,
        its disk is full) is reported (health) and raised as NotReady: UNAVAILABLE to the
        caller, who may try again; the process goes on. Only a `write` that succeeds
        says the store is well again: a store may answer reads while it refuses writes
        (a write lock held elsewhere, a full disk)."""
        try:
            result = await asyncio.to_thread(call, *args)
        except self.store.FAILURES as error:
            await self.health.failed(FAILING, error)
            raise NotReady(f"the agent's run store failed; try again: {error}") from None
        if write:
            await self.health.succeeded()
        return result

    def _clock(self) -> float:
        return asyncio.get_running_loop().time()

    async def start(self, request: agent_pb2.RunRequest, client: str, execute: Execute) -> LiveRun:
        """A new run, recorded under this replica's lease, running `execute` in a task
        of its own."""
        if self._room() <= 0:
            raise Overloaded(
                f"{len(self.live)} runs are in progress here, the most this agent runs",
                retry_after_s=1.0,
            )
        run = LiveRun(uuid.uuid4().hex, client)
        run.held_until = self._clock() + self.lease.seconds
        await self.stored(self.store.create, request, run.run_id, client, self.lease, write=True)
        self._launch(run, execute)
        return run

    def _launch(self, run: LiveRun, execute: Execute) -> None:
        self.live[run.run_id] = run
        run.task = asyncio.create_task(execute(run), name="agent-run")

        def ended(_: asyncio.Task[None]) -> None:
            # Not a later run of the same id: one that lost its lease here may be claimed
            # back by this replica before its old task has ended.
            if self.live.get(run.run_id) is run:
                del self.live[run.run_id]
            run.wake()  # a run that lost its lease ends without a last event

        run.task.add_done_callback(ended)

    async def adopt(self, orphan: Orphan, execute: Execute) -> LiveRun:
        """A claimed run, here now: its stored events first, so numbering goes on."""
        run = LiveRun(orphan.run_id, orphan.client)
        run.events = await self.stored(self._all_events, orphan.run_id)
        self._launch(run, execute)
        return run

    def _all_events(self, run_id: str) -> list[agent_pb2.RunResponse]:
        events: list[agent_pb2.RunResponse] = []
        while page := self.store.events(run_id, len(events)):
            events += page
        return events

    def _lose(self, run: LiveRun, why: str) -> None:
        """Stops a run this replica no longer holds, with no last event of its own: the
        run is not over, it goes on where it is claimed (possibly here again, once the
        store answers and its lease has run out). Its caller's stream ends UNAVAILABLE,
        saying to re-attach."""
        if run.lost:
            return
        run.lost = True
        run.error = NotReady(
            f"this agent replica lost its lease on run {run.run_id} ({why}); the run goes "
            "on where it is taken over: re-attach with Attach(run_id, after_seq)"
        )
        log.warning("run stopped here: its lease is lost", extra={"run_id": run.run_id, "why": why})
        if run.task is not None and not run.task.done():
            run.task.cancel()

    async def _append(
        self,
        run: LiveRun,
        event: agent_pb2.RunResponse,
        state: int,
        checkpoint: bytes | None,
    ) -> bool:
        """Stores one event, tried again with backoff while the store fails and the
        run's lease may still hold; LeaseLost once it may not (another replica may claim
        the run from then on) or once the store says another holds it."""
        while True:
            try:
                cancel_asked = await asyncio.to_thread(
                    self.store.append, event, state, checkpoint, owner=self.lease.owner
                )
            except self.store.FAILURES as error:
                await self.health.failed(FAILING, error)
                left_s = self._lease_left(run)
                if left_s <= 0:
                    raise LeaseLost(
                        f"the run store did not answer for its whole lease ({error})"
                    ) from None
                await asyncio.sleep(min(self.health.retry_in(), left_s))
                continue
            await self.health.succeeded()
            return cancel_asked

    async def emit(
        self,
        run: LiveRun,
        event: agent_pb2.RunResponse,
        state: int = RUNNING,
        checkpoint: bytes | None = None,
    ) -> None:
        """Numbers, stores (with the loop's state after it, when given) and publishes
        one event; a Cancel made on another replica cancels this run here, at this step.
        A run whose lease is lost is cancelled here instead (`_lose`), nothing stored."""
        if run.lost:
            raise asyncio.CancelledError
        event.run_id, event.seq = run.run_id, len(run.events) + 1
        write = asyncio.ensure_future(self._append(run, event, state, checkpoint))
        try:
            cancel_asked = await asyncio.shield(write)
        except asyncio.CancelledError:
            # Stored either way: published too, so the next event's seq follows it.
            try:
                await write
            except LeaseLost as lost:
                self._lose(run, str(lost))
                raise asyncio.CancelledError from None
            run.publish(event, state)
            raise
        except LeaseLost as lost:
            self._lose(run, str(lost))
            raise asyncio.CancelledError from None
        run.publish(event, state)
        if cancel_asked and state == RUNNING and run.task is asyncio.current_task():
            run.task.cancel()

    async def record(self, run_id: str, client: str) -> RunRecord:
        found = await self.stored(self.store.get, run_id, client)
        if found is None:
            raise NotFound(f"no run {run_id!r}", resource_type="run", resource_name=run_id)
        return found

    def _here(self, run_id: str, client: str) -> LiveRun | None:
        run = self.live.get(run_id)
        return run if run is not None and run.client == client and not run.lost else None

    async def follow(
        self, run_id: str, client: str, after_seq: int
    ) -> AsyncIterator[agent_pb2.RunResponse]:
        """The run's events after `after_seq` to its end: from this process while it
        runs here, else from the store (polled while another replica runs it, or after
        this one lost its lease on it)."""
        record = await self.record(run_id, client)
        sent = after_seq
        while True:
            here = self._here(run_id, client)
            if here is not None:
                async for event in here.follow(sent):
                    sent = event.seq
                    yield event
                if not here.lost:
                    return
                continue
            events = await self.stored(self.store.events, run_id, sent)
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
            if not here.lost:
                return here.state
        record = await self.record(run_id, client)
        if record.ended:
            return record.state
        await self.stored(self.store.request_cancel, run_id, write=True)
        deadline = self._clock() + CANCEL_WAIT_S
        while not record.ended and self._clock() < deadline:
            await asyncio.sleep(self.poll_s)
            record = await self.record(run_id, client)
        return record.state

    async def upkeep(self, resume: Resume) -> None:
        """Every poll: stops the runs here that a Cancel on another replica asked to stop
        (even one waiting on a tool that sends nothing), renews this replica's leases,
        and takes over runs whose replica stopped renewing (a background task; the
        server watches it).

        It never ends on its own: a store that fails (down, locked, full) is reported
        (health: metric, one log line per change, `agent.run_store` NOT_SERVING) and
        tried again with backoff. A run whose lease may have run out meanwhile, or that
        another replica holds now, is stopped here (`_lose`), so that no run goes on in
        two places."""
        renew_at = self._clock()
        while True:
            failing = self.health.state == FAILING
            # The renewal is a write: after a failure it is what shows the store is back.
            renewing = failing or self._clock() >= renew_at
            try:
                await self._keep_up(resume, renewing)
            except Exception as error:  # whatever it was, the process stays
                if not isinstance(error, (NotReady, *self.store.FAILURES)):
                    log.exception("run upkeep failed")
                await self.health.failed(FAILING, error)
            else:
                if renewing:
                    await self.health.succeeded()
                    # A few renewals per lease: one late renewal does not lose a run.
                    renew_at = self._clock() + self.lease.seconds / 4
            self._stop_lapsed()
            # While failing, tried again soon enough for a renewal to beat the lease.
            await asyncio.sleep(
                min(self.health.retry_in(), self.lease.seconds / 4)
                if self.health.state == FAILING
                else self.poll_s
            )

    async def _keep_up(self, resume: Resume, renewing: bool) -> None:
        # A run stopped for its lease is not renewed: whoever claims it next must not wait.
        here = [run_id for run_id, run in self.live.items() if not run.lost]
        for run_id in await asyncio.to_thread(self.store.cancels_asked, here):
            run = self.live.get(run_id)
            if run is not None and run.task is not None and run.running:
                run.task.cancel()
        if not renewing:
            return
        asked_at = self._clock()
        held = set(await asyncio.to_thread(self.store.renew, self.lease, here))
        for run_id in here:
            run = self.live.get(run_id)
            if run is None or not run.running:
                continue
            if run_id in held:
                run.held_until = asked_at + self.lease.seconds
            else:
                self._lose(run, "another replica took it over")
        if self._room() <= 0:
            return
        asked_at = self._clock()
        for orphan in await asyncio.to_thread(self.store.claim_orphans, self.lease, self._room()):
            log.warning(
                "resuming a run whose replica stopped renewing its lease",
                extra={"run_id": orphan.run_id, "events": orphan.events},
            )
            await resume(orphan)
            adopted = self.live.get(orphan.run_id)
            if adopted is not None:
                adopted.held_until = asked_at + self.lease.seconds

    def _lease_left(self, run: LiveRun) -> float:
        """Seconds this replica surely holds the run still: until a lease after its last
        renewal began, less a tenth of a lease for the replicas' clocks (another
        replica claims it by its own clock, from the expiry this one wrote)."""
        return run.held_until - self.lease.seconds / 10 - self._clock()

    def _stop_lapsed(self) -> None:
        """Stops the runs this replica may no longer hold: from then on another replica
        may claim them."""
        for run in list(self.live.values()):
            if run.running and self._lease_left(run) <= 0:
                self._lose(run, "the run store did not answer for longer than its lease")

    async def close(self) -> None:
        """Stops every run here (the process is shutting down)."""
        await asyncio.gather(*(run.stop() for run in list(self.live.values())))
