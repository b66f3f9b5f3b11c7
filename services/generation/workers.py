"""Which prefill and decode worker serves a request.

Prefill workers take turns (round robin); a prompt's cost is known and short. Decode
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
from dataclasses import dataclass

import grpc

from aimesh.llm.v1 import decode_pb2, decode_pb2_grpc
from mesh.breaker import State
from mesh.client import ChannelPool
from mesh.failures import NotReady

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


class PrefillPicker:
    def __init__(self, targets: list[str], channels: ChannelPool) -> None:
        if not targets:
            raise ValueError("no prefill workers configured")
        self.targets = targets
        self.channels = channels
        self._turn = itertools.cycle(targets)

    def pick(self) -> str:
        """The next worker in turn whose breaker is not open; the first when every one is."""
        for _ in self.targets:
            target = next(self._turn)
            if not _open(self.channels, target):
                return target
        return self.targets[0]


class DecodePicker:
    def __init__(
        self, targets: list[str], channels: ChannelPool, poll_interval_s: float = 0.25
    ) -> None:
        if not targets:
            raise ValueError("no decode workers configured")
        self.workers = {target: _Worker(target) for target in targets}
        self.channels = channels
        self.poll_interval_s = poll_interval_s
        self._probes = {target: grpc.aio.insecure_channel(target) for target in targets}
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
