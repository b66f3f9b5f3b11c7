"""The one way tests start services.

Service tests start them in this process (`InProcess`: a MeshServer as its ServiceSpec
declares it, on an ephemeral port); system tests start `aimesh serve` processes through
mesh.supervisor, the code `aimesh up` runs (`ServiceProcesses`). Both stop what they
started however the test ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from mesh import supervisor
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.registry import discover
from mesh.server import MeshServer

T = TypeVar("T")
Setup = Callable[[MeshServer], Awaitable[Any]]


@dataclass
class Served:
    """A service running in this process: its server, what its setup returned (the
    servicer, to watch its state) and its address."""

    server: MeshServer
    servicer: Any

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


class InProcess:
    """Services in this process on 127.0.0.1 ephemeral ports, with mesh channels to them;
    all drained and closed when the `async with` block ends."""

    def __init__(self) -> None:
        self._servers: list[MeshServer] = []
        self._channels: list[grpc.aio.Channel] = []

    async def start(
        self, name: str, settings: MeshSettings | None = None, *, setup: Setup | None = None
    ) -> Served:
        """`name` as `aimesh serve` runs it (its registered setup unless `setup` is given),
        ready when this returns."""
        server = MeshServer.for_service(name, settings or MeshSettings(), port=0)
        self._servers.append(server)
        servicer = await (setup or discover()[name].load_setup())(server)
        await server.start()
        return Served(server, servicer)

    def channel(
        self, target: str, *services: ServiceDescriptor, settings: MeshSettings | None = None
    ) -> grpc.aio.Channel:
        """A mesh channel (tracing, request id, deadline, breaker), closed at the end."""
        channel = create_channel(target, settings or MeshSettings(), services=services)
        self._channels.append(channel)
        return channel

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        for server in self._servers:
            await server.drain(0)

    async def __aenter__(self) -> InProcess:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


class ServiceProcesses:
    """`aimesh serve` children under mesh.supervisor, on an event loop of their own in a
    thread: a module's processes outlive each test's event loop, and sync fixtures and
    async tests drive them alike. `close` drains them with SIGTERM and kills what
    outlives the grace period."""

    def __init__(self, logs: Path, env: Mapping[str, str] | None = None) -> None:
        self.logs = logs
        self.env = dict(env or {})
        self.children: dict[str, supervisor.Child] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def _submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def _launch(self, label: str, service: str, port: int, env: dict[str, str]) -> None:
        child = await supervisor.start(
            discover()[service],
            MeshSettings(),
            self.logs / f"{label}.log",
            port=port,
            env={**self.env, **env},
        )
        self.children[label] = child

    async def _ready(self, labels: list[str], timeout_s: float) -> None:
        """Until every child is ready; fails as soon as one dies or times out, with its log,
        instead of waiting out the others (a router waits for workers that already died)."""

        async def one(label: str) -> None:
            child = self.children[label]
            took = await supervisor.wait_ready([child], timeout_s)
            if took[child.spec.name] is None:
                log = (self.logs / f"{label}.log").read_text()[-3000:]
                raise AssertionError(f"{label} did not become ready on {child.target}:\n{log}")

        waits = [asyncio.create_task(one(label)) for label in labels]
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()

    async def _start(self, units: list[tuple[str, str, int, dict[str, str]]], timeout_s: float):
        for label, service, port, env in units:
            await self._launch(label, service, port, env)
        await self._ready([unit[0] for unit in units], timeout_s)

    def start_all(
        self, units: list[tuple[str, str, int, dict[str, str]]], timeout_s: float = 180
    ) -> None:
        """Starts every (label, service, port, env) at once and waits until all are ready."""
        self._submit(self._start(units, timeout_s)).result()

    async def start(
        self, label: str, service: str, port: int, timeout_s: float = 180, **env: str
    ) -> supervisor.Child:
        """One more child, from an async test: ready when this returns."""
        await asyncio.wrap_future(
            self._submit(self._start([(label, service, port, env)], timeout_s))
        )
        return self.children[label]

    def signal(self, label: str, sig: signal.Signals) -> None:
        self._loop.call_soon_threadsafe(self.children[label].process.send_signal, sig)

    async def wait(self, label: str) -> int:
        """The child's exit status, once it has exited."""
        return await asyncio.wrap_future(self._submit(self.children[label].process.wait()))

    def close(self, grace_s: float = 20) -> None:
        try:
            self._submit(supervisor.stop(list(self.children.values()), grace_s)).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
