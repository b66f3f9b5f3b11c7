"""One service process: a grpc.aio server with the mesh's guarantees built in.

Health (grpc.health.v1): `""` answers SERVING as soon as the process listens (liveness);
the service's own name and each of its proto service names answer SERVING only after
every warm-up has run (readiness), follow the readiness probes of a remote engine (e.g.
Triton's ModelReady) after that, and go NOT_SERVING when draining. Until the warm-ups
end, and after a watched task died, every call is answered UNAVAILABLE (NOT_READY) here,
so no servicer guards its engine with a "still loading" check. Reflection is on for
grpcurl unless the config says `reflection = false` (the Kubernetes one does). On
SIGTERM: NOT_SERVING, new calls refused, in-flight calls (streams included) get the grace
period to finish, then the process exits.

Background tasks a service cannot work without (a batch scheduler, a load poller) are
`watch`ed: if one ends while the server runs, the process is broken, and says so instead
of answering SERVING while its streams hang: liveness and readiness go NOT_SERVING, the
task's owner fails what waited on it (UNAVAILABLE), and the server drains and exits with
status 1, so its supervisor (`aimesh up`, Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from aimesh.mesh.v1 import info_pb2_grpc
from mesh import tracing
from mesh.admission import Admission
from mesh.authz import Policy
from mesh.caller_token import TokenVerifier
from mesh.client import ChannelPool, transport_options
from mesh.config import MeshSettings, ServiceOptions
from mesh.failures import NotReady
from mesh.info import SERVICE as INFO_SERVICE
from mesh.info import InfoServicer, ModelInfo
from mesh.interceptors import MeshServerInterceptor
from mesh.metrics import record_cold_start, watch_event_loop
from mesh.registry import discover
from mesh.tls import server_credentials, terminates_here

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

OptionsT = TypeVar("OptionsT", bound=ServiceOptions)
Hook = Callable[[], Awaitable[None]]
Probe = Callable[[], Awaitable[bool]]
OnDeath = Callable[[BaseException], None]
# The process exits with this status after a watched task died, so supervisors restart it.
BROKEN_EXIT_STATUS = 1


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
        dependencies: Iterable[str] = (),
        callers: Iterable[tuple[str, Iterable[str]]] = (),
    ) -> None:
        self.name = name
        self.dependencies = frozenset(dependencies)
        self._dependency_targets: dict[str, str] = {}
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
        self.channels = ChannelPool(settings)
        self.health = HealthServicer()
        self.health_server: grpc.aio.Server | None = None  # [tls] health_port_offset
        self._proto_services: list[str] = []
        self._warmups: list[Hook] = []
        self._shutdown_hooks: list[Hook] = []
        self._executors: list[ThreadPoolExecutor] = []
        self._probes: list[Probe] = []
        self._following: asyncio.Task[None] | None = None
        # Watched tasks, each with the callback that reports its end.
        self._watched: dict[asyncio.Task[Any], Callable[[asyncio.Task[Any]], None]] = {}
        self._breaking: asyncio.Task[None] | None = None
        self._draining = False
        self._warm = False
        self.broken = asyncio.Event()
        self.grpc_server = grpc.aio.server(
            interceptors=[
                *tracing.server_interceptors(),
                MeshServerInterceptor(
                    self.admission, exempt_methods, self._refusal, self._policy(callers)
                ),
            ],
            options=self._server_options(),
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        self.info = InfoServicer(name, lambda: self._warm)
        info_pb2_grpc.add_InfoServiceServicer_to_server(self.info, self.grpc_server)

    @classmethod
    def for_service(
        cls, name: str, settings: MeshSettings, *, port: int | None = None
    ) -> MeshServer:
        """A server as its ServiceSpec declares it (admission exemptions, default slots,
        dependencies), on the configured port unless `port` is given (0: any free one)."""
        spec = discover()[name]
        return cls(
            name,
            settings,
            port=settings.port_of(name, spec.default_port) if port is None else port,
            host=settings.service(name).host,
            exempt_methods=spec.exempt_methods,
            default_max_concurrency=spec.max_concurrency,
            dependencies=spec.dependencies,
            callers=spec.callers,
        )

    def _policy(self, callers: Iterable[tuple[str, Iterable[str]]]) -> Policy | None:
        """The callers' allow-lists when callers have identities to check: their mutual TLS
        certificates, or their signed tokens where a sidecar ends TLS."""
        tls = self.settings.tls
        if tls is None or not tls.authorize_callers:
            return None
        if tls.caller_tokens:
            return Policy(callers, TokenVerifier(tls).identity)
        return Policy(callers)

    def _refusal(self) -> NotReady | None:
        """Why a call cannot be served now; None when it can."""
        if self.broken.is_set():
            return NotReady(f"{self.name} is broken and about to restart; retry elsewhere")
        if not self._warm:
            return NotReady(f"{self.name} is still loading")
        return None

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

    def options_as(self, model: type[OptionsT]) -> OptionsT:
        """This service's own keys of [services.<name>], validated by `model`."""
        return model.of(self.settings, self.name)

    def dependency_target(self, name: str) -> str:
        """The address a declared dependency is dialled at: this service's override in
        `[services.<self>.dependencies]`, else that service's configured target."""
        target = self._dependency_targets.get(name)
        if target is None:  # once per name: discover() reads entry points (~3 ms)
            if name not in self.dependencies:
                raise ValueError(f"{self.name} does not declare a dependency on {name!r}")
            override = self.settings.service(self.name).dependencies.get(name)
            target = override or self.settings.target_of(name, discover()[name].default_port)
            self._dependency_targets[name] = target
        return target

    def channel_to(self, name: str, *services: ServiceDescriptor) -> grpc.aio.Channel:
        """The mesh channel (tracing, request id, deadline, breaker, retries for the
        `services`' idempotent methods) to a declared dependency."""
        return self.channels.get(self.dependency_target(name), *services)

    def describe(self, model: ModelInfo) -> None:
        """Says what this process serves (GetInfo): call it once the model is loaded."""
        self.info.models.append(model)

    def executor(self, name: str, threads: int = 1) -> ThreadPoolExecutor:
        """Threads for an engine's blocking work (a model's forward passes), owned here:
        work still queued is dropped when the server has drained."""
        executor = ThreadPoolExecutor(threads, thread_name_prefix=f"{self.name}-{name}")
        self._executors.append(executor)
        return executor

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

    async def _probe(self, probe: Probe) -> bool:
        """A probe that raises answers "not ready"; it must not end the following."""
        try:
            return await probe()
        except Exception:
            log.exception("readiness probe failed")
            return False

    async def _follow_probes(self, interval_s: float = 1.0) -> None:
        ready = True
        while True:
            await asyncio.sleep(interval_s)
            now = all([await self._probe(probe) for probe in self._probes])
            if now != ready:
                log.warning("readiness follows a remote engine", extra={"ready": now})
                await self.set_ready(now)
                ready = now

    def watch(self, task: asyncio.Task[Any], on_death: OnDeath | None = None) -> None:
        """Treats the end of `task` before draining as the end of this process's health:
        `on_death(NotReady)` fails whatever waited on the task, then liveness and
        readiness go NOT_SERVING and `serve_until_signal` drains and exits with status 1."""

        def ended(done: asyncio.Task[Any]) -> None:
            self._watched.pop(done, None)
            if self._draining:
                return
            error = None if done.cancelled() else done.exception()
            log.error(
                "background task ended; this process is broken and will exit",
                extra={"task": done.get_name()},
                exc_info=error,
            )
            if on_death is not None:
                on_death(NotReady(f"{self.name}: {done.get_name()} stopped; retry elsewhere"))
            # Kept: the loop holds tasks only weakly, and this one must run to its end.
            self._breaking = asyncio.get_running_loop().create_task(self._break())

        self._watched[task] = ended
        task.add_done_callback(ended)

    def unwatch(self, task: asyncio.Task[Any]) -> None:
        """Stops watching `task` before its owner ends it on purpose (a model version
        that drained stops its load poll): that end is no fault of the process."""
        ended = self._watched.pop(task, None)
        if ended is not None:
            task.remove_done_callback(ended)

    async def _break(self) -> None:
        await self.set_ready(False)
        await self.health.set("", NOT_SERVING)
        self.broken.set()

    @property
    def readiness_names(self) -> list[str]:
        return [self.name, *self._proto_services]

    async def start(self) -> int:
        """Listens, answers liveness at once, warms up, then flips readiness to SERVING."""
        if self.settings.reflection:
            reflection.enable_server_reflection(
                [
                    *self._proto_services,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    INFO_SERVICE.full_name,
                    reflection.SERVICE_NAME,
                ],
                self.grpc_server,
            )
        address = f"{self.host}:{self.requested_port}"
        tls = self.settings.tls
        self.port = (
            self.grpc_server.add_secure_port(address, server_credentials(tls))
            if tls is not None and terminates_here(tls)
            else self.grpc_server.add_insecure_port(address)
        )
        if self.port == 0:
            raise OSError(f"{self.name}: cannot bind {self.host}:{self.requested_port}")
        if tls is not None and terminates_here(tls) and tls.health_port_offset is not None:
            self.health_server = self._plaintext_health(self.port + tls.health_port_offset)
        await self.set_ready(False)
        await self.grpc_server.start()
        if self.health_server is not None:
            await self.health_server.start()
        watch_event_loop(asyncio.get_running_loop())
        log.info("listening", extra={"address": f"{self.host}:{self.port}"})
        for warmup in self._warmups:
            await warmup()
        self._warm = True
        await self.set_ready(True)
        log.info("ready", extra={"cold_start_s": round(record_cold_start(), 3)})
        if self._probes:
            self._following = asyncio.create_task(self._follow_probes(), name="readiness")
            self.watch(self._following)
        return self.port

    def _plaintext_health(self, port: int) -> grpc.aio.Server:
        """The same health answers without TLS, on a port that serves nothing else: the
        kubelet's gRPC probes present no certificate, and health says nothing secret."""
        server = grpc.aio.server(options=self._server_options())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if server.add_insecure_port(f"{self.host}:{port}") == 0:
            raise OSError(f"{self.name}: cannot bind the health port {self.host}:{port}")
        return server

    async def set_ready(self, ready: bool) -> None:
        for name in self.readiness_names:
            await self.health.set(name, SERVING if ready else NOT_SERVING)

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        grace = self.grace_s if grace_s is None else grace_s
        log.info("draining", extra={"grace_s": grace})
        self._draining = True
        if self._following is not None:
            self._following.cancel()
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        for hook in self._shutdown_hooks:
            await hook()
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)
        await self.channels.close()
        log.info("stopped")

    async def serve_until_signal(self) -> int:
        """Runs until SIGTERM or SIGINT, then drains; a signal during warm-up drains too.
        Returns the process's exit status: 0, or BROKEN_EXIT_STATUS after a watched task
        died (the process then drains and ends on its own)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        starting = asyncio.create_task(self.start())
        stopping = asyncio.create_task(stop.wait())
        breaking = asyncio.create_task(self.broken.wait())
        await asyncio.wait({starting, stopping, breaking}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
        elif starting.exception() is None:
            await asyncio.wait({stopping, breaking}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        breaking.cancel()
        await self.drain()
        if starting.done() and not starting.cancelled() and starting.exception() is not None:
            raise starting.exception()
        return BROKEN_EXIT_STATUS if self.broken.is_set() else 0
