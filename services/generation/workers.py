"""Which prefill and decode worker serves a request.

A prompt goes to the prefill worker it shares the longest prefix with (by the block hashes
of the prompts sent to each, so that worker's prefix cache probably holds it), falling back
to the least busy, in turn among equals. Decode
workers are picked by load: a background poll of GetLoad every `poll_interval_s` keeps
each worker's running + waiting count, calls placed since the last poll are added, and a
worker whose poll failed or whose circuit breaker is open is skipped while any other is
healthy. Failure of a pick is reported back so the next pick avoids it at once, before
the poll notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from aimesh.llm.v1 import decode_pb2, decode_pb2_grpc
from mesh.breaker import State
from mesh.client import ChannelPool
from mesh.failures import NotReady
from mesh.tls import TlsSettings, plain_channel
from services.llm.prefix import UNSCOPED, block_hashes

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    target: str
    load: int = 0
    healthy: bool = True


def _open(channels: ChannelPool, target: str) -> bool:
    """Whether the circuit breaker of `target` is open."""
    breaker = channels.breakers.get(target)
    return breaker is not None and breaker.state is State.OPEN


@dataclass(eq=False)
class _PrefillWorker:
    target: str
    in_flight: int = 0
    # Block hashes of the prompts sent here, least recently sent first: what this
    # worker's prefix cache probably holds.
    sent: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def cached_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt were sent here before."""
        for count, chain in enumerate(hashes):
            if chain not in self.sent:
                return count
        return len(hashes)

    def remember(self, hashes: list[int]) -> None:
        for chain in hashes:
            self.sent[chain] = None
            self.sent.move_to_end(chain)
        while len(self.sent) > REMEMBERED_BLOCKS:
            self.sent.popitem(last=False)


# Per prefill worker: 64k prompt tokens, several times what a default prefix cache holds
# (256 MiB of f16 KV is about 11k tokens of the embedded model), so the router forgets a
# prefix after the worker has, not before.
REMEMBERED_BLOCKS = 4096
# A prompt goes to the worker with its prefix unless that one has this many more prefills
# in flight than the least busy: a popular prefix must not queue every prompt on one worker.
AFFINITY_SLACK = 2


class PrefillPicker:
    def __init__(self, targets: list[str], channels: ChannelPool) -> None:
        if not targets:
            raise ValueError("no prefill workers configured")
        self.workers = [_PrefillWorker(target) for target in targets]
        self.channels = channels
        self._turn = itertools.count()

    def pick(self, prompt_ids: list[int], scope: int = UNSCOPED) -> str:
        """The worker that was sent the longest prefix of this prompt in its cache scope
        (at least one block),
        unless it is busier than the least busy by more than AFFINITY_SLACK; else the least
        busy, in turn among equals. Workers whose breaker is open are skipped while any
        other is closed. Call `done` when its prefill ends."""
        usable = [w for w in self.workers if not _open(self.channels, w.target)] or self.workers
        hashes = block_hashes(prompt_ids, scope=scope) if len(usable) > 1 else []
        least = min(worker.in_flight for worker in usable)
        chosen, longest = None, 0
        for worker in usable:
            blocks = worker.cached_blocks(hashes)
            if blocks > longest and worker.in_flight <= least + AFFINITY_SLACK:
                chosen, longest = worker, blocks
        if chosen is None:
            start = next(self._turn) % len(usable)
            in_turn = usable[start:] + usable[:start]
            chosen = next(worker for worker in in_turn if worker.in_flight == least)
        chosen.remember(hashes)
        chosen.in_flight += 1
        return chosen.target

    def done(self, target: str) -> None:
        for worker in self.workers:
            if worker.target == target:
                worker.in_flight -= 1


class DecodePicker:
    def __init__(
        self,
        targets: list[str],
        channels: ChannelPool,
        poll_interval_s: float = 0.25,
        tls: TlsSettings | None = None,
    ) -> None:
        if not targets:
            raise ValueError("no decode workers configured")
        self.workers = {target: _Worker(target) for target in targets}
        self.channels = channels
        self.poll_interval_s = poll_interval_s
        self._probes = {target: plain_channel(target, tls) for target in targets}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Starts the load poll; the caller watches it (picks on loads that stopped
        changing would pile every request onto one worker)."""
        self._task = asyncio.create_task(self._poll_forever(), name="decode-load-poll")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for channel in self._probes.values():
            await channel.close()

    @property
    def any_healthy(self) -> bool:
        return any(worker.healthy for worker in self.workers.values())

    def pick(self, exclude: frozenset[str] = frozenset()) -> str:
        candidates = [w for w in self.workers.values() if w.target not in exclude]
        if not candidates:
            raise NotReady("every decode worker failed this request")
        usable = [w for w in candidates if w.healthy and not _open(self.channels, w.target)]
        usable = usable or candidates
        chosen = min(usable, key=lambda w: w.load)
        chosen.load += 1
        return chosen.target

    def report_failure(self, target: str) -> None:
        self.workers[target].healthy = False

    async def poll(self) -> None:
        async def one(worker: _Worker) -> None:
            stub = decode_pb2_grpc.DecodeServiceStub(self._probes[worker.target])
            try:
                load = await stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=0.5)
            except Exception as error:  # one worker's bad answer must not stop polling the rest
                if not isinstance(error, grpc.aio.AioRpcError):
                    log.exception("decode load poll failed", extra={"target": worker.target})
                worker.healthy = False
                return
            worker.healthy = True
            worker.load = load.running + load.waiting

        await asyncio.gather(*(one(w) for w in self.workers.values()))

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.poll_interval_s)
