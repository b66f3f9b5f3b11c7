"""One service process: a grpc.aio server with the mesh's guarantees built in.

Health (grpc.health.v1): `""` answers SERVING as soon as the process listens (liveness);
the service's own name and each of its proto service names answer SERVING only after
every warm-up has run (readiness), follow the readiness probes of a remote engine (e.g.
Triton's ModelReady) after that, and go NOT_SERVING when draining. Reflection is on for
grpcurl. On SIGTERM: NOT_SERVING, new calls refused, in-flight calls (streams included)
get the grace period to finish, then the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from mesh import tracing
from mesh.admission import Admission
from mesh.client import ChannelPool, transport_options
from mesh.config import MeshSettings
from mesh.interceptors import MeshServerInterceptor
from mesh.metrics import watch_event_loop

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Hook = Callable[[], Awaitable[None]]
Probe = Callable[[], Awaitable[bool]]


class MeshServer:
    def __init__(
        self,
        name: str,
        settings: MeshSettings,
        *,
        port: int,
        host: str = "127.0.0.1",
        exempt_methods: Iterable[str] = (),
        default_max_concurrency: int = 4,
    ) -> None:
        self.name = name
        self.settings = settings
        self.host = host
        self.requested_port = port
        self.port = 0
        service = settings.service(name)
        self.admission = Admission(
            name,
            max_concurrency=service.max_concurrency or default_max_concurrency,
            max_queue=service.max_queue,
        )
        self.grace_s = service.grace_s
        self.options = service.options
        self.channels = ChannelPool(settings)
        self.health = HealthServicer()
        self._proto_services: list[str] = []
        self._warmups: list[Hook] = []
        self._shutdown_hooks: list[Hook] = []
        self._probes: list[Probe] = []
        self._following: asyncio.Task[None] | None = None
        self.grpc_server = grpc.aio.server(
            interceptors=[
                *tracing.server_interceptors(),
                MeshServerInterceptor(self.admission, exempt_methods),
            ],
            options=self._server_options(),
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)

    def _server_options(self) -> list[tuple[str, Any]]:
        transport = self.settings.transport
        options = [
            *transport_options(transport),
            ("grpc.max_concurrent_streams", transport.max_concurrent_streams),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
            # Never answer a mesh client's keepalive with GOAWAY "too_many_pings": a long
            # client stream the server reads slowly (an ingest under load) drew one once and
            # failed with UNAVAILABLE. Clients are the mesh's own; Envoy fronts outsiders.
            ("grpc.http2.max_ping_strikes", 0),
            # Without this, Linux lets two servers bind one port and split its traffic.
            ("grpc.so_reuseport", 0),
        ]
        if transport.max_connection_age_s is not None:
            options += [
                ("grpc.max_connection_age_ms", int(transport.max_connection_age_s * 1000)),
                (
                    "grpc.max_connection_age_grace_ms",
                    int(transport.max_connection_age_grace_s * 1000),
                ),
            ]
        return options

    def add_service(
        self,
        register: Callable[[Any, grpc.aio.Server], None],
        servicer: Any,
        descriptor: ServiceDescriptor,
    ) -> None:
        """Registers a servicer, e.g. add_service(add_EchoServiceServicer_to_server, ...)."""
        register(servicer, self.grpc_server)
        self._proto_services.append(descriptor.full_name)

    def add_warmup(self, hook: Hook) -> None:
        """Runs after the server listens and before readiness (model load, first forward)."""
        self._warmups.append(hook)

    def add_shutdown(self, hook: Hook) -> None:
        """Runs after draining: free engines, flush stores."""
        self._shutdown_hooks.append(hook)

    def add_readiness_probe(self, probe: Probe) -> None:
        """After warm-up, readiness is also `probe()`'s answer, polled every second: a
        service whose model runs elsewhere is ready only while that model is."""
        self._probes.append(probe)

    async def _follow_probes(self, interval_s: float = 1.0) -> None:
        ready = True
        while True:
            await asyncio.sleep(interval_s)
            now = all([await probe() for probe in self._probes])
            if now != ready:
                log.warning("readiness follows a remote engine", extra={"ready": now})
                await self.set_ready(now)
                ready = now

    @property
    def readiness_names(self) -> list[str]:
        return [self.name, *self._proto_services]

    async def start(self) -> int:
        """Listens, answers liveness at once, warms up, then flips readiness to SERVING."""
        reflection.enable_server_reflection(
            [
                *self._proto_services,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.grpc_server,
        )
        self.port = self.grpc_server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if self.port == 0:
            raise OSError(f"{self.name}: cannot bind {self.host}:{self.requested_port}")
        await self.set_ready(False)
        await self.grpc_server.start()
        watch_event_loop(asyncio.get_running_loop())
        log.info("listening", extra={"address": f"{self.host}:{self.port}"})
        for warmup in self._warmups:
            await warmup()
        await self.set_ready(True)
        log.info("ready")
        if self._probes:
            self._following = asyncio.create_task(self._follow_probes(), name="readiness")
        return self.port

    async def set_ready(self, ready: bool) -> None:
        for name in self.readiness_names:
            await self.health.set(name, SERVING if ready else NOT_SERVING)

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        grace = self.grace_s if grace_s is None else grace_s
        log.info("draining", extra={"grace_s": grace})
        if self._following is not None:
            self._following.cancel()
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        for hook in self._shutdown_hooks:
            await hook()
        await self.channels.close()
        log.info("stopped")

    async def serve_until_signal(self) -> None:
        """Runs until SIGTERM or SIGINT, then drains; a signal during warm-up drains too."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        starting = asyncio.create_task(self.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
        elif starting.exception() is None:
            await stopping
        stopping.cancel()
        await self.drain()
        if starting.done() and not starting.cancelled() and starting.exception() is not None:
            raise starting.exception()
