"""`aimesh up`: every service in its own process, on its own port, over real loopback gRPC.

The supervisor starts `aimesh serve NAME` per service, waits until each answers readiness,
restarts a service whose process exits (a crash, or a service that found itself broken
and exited 1) after a backoff, and on Ctrl-C or SIGTERM passes SIGTERM on so every
service drains its in-flight calls, killing only what outlives its grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from mesh.registry import ServiceSpec
from mesh.tls import TlsSettings

# Restart backoff: doubles from the first delay to the cap, and starts over once a
# process has stayed up for STABLE_S (a crash loop waits longer each time; a rare crash
# is restarted at once).
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STABLE_S = 60.0


@dataclass
class Child:
    spec: ServiceSpec
    target: str
    process: asyncio.subprocess.Process
    log_file: Path | None = None
    restarts: int = 0
    # A replica on a port of its own (`aimesh serve NAME --port N`), and its environment
    # beyond this process's: what a restart must repeat.
    port: int | None = None
    env: dict[str, str] = field(default_factory=dict)


OnRestart = Callable[[Child, int, float], None]


async def _spawn(
    spec: ServiceSpec, log_file: Path | None, port: int | None, env: dict[str, str]
) -> asyncio.subprocess.Process:
    # One process per service, so one trace resource name per service.
    env = {**os.environ, "OTEL_SERVICE_NAME": f"aimesh-{spec.name}", **env}
    port_args = [] if port is None else ["--port", str(port)]
    stderr = None if log_file is None else log_file.open("ab")
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mesh.cli", "serve", spec.name, *port_args, env=env,
            stderr=stderr,
        )  # fmt: skip
    finally:
        if stderr is not None:
            stderr.close()


async def start(
    spec: ServiceSpec,
    settings: MeshSettings,
    log_file: Path | None,
    *,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> Child:
    """`aimesh serve` for `spec` as a child process, on its configured port or `port`."""
    target = (
        settings.target_of(spec.name, spec.default_port) if port is None else f"127.0.0.1:{port}"
    )
    env = env or {}
    process = await _spawn(spec, log_file, port, env)
    return Child(spec, target, process, log_file, port=port, env=env)


async def keep_running(child: Child, on_restart: OnRestart) -> None:
    """Restarts `child` whenever its process exits, with a growing delay between tries;
    `on_restart(child, exit_code, delay_s)` is told before each wait."""
    delay = FIRST_RESTART_DELAY_S
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        code = await child.process.wait()
        if loop.time() - started >= STABLE_S:
            delay = FIRST_RESTART_DELAY_S
        on_restart(child, code, delay)
        await asyncio.sleep(delay)
        child.process = await _spawn(child.spec, child.log_file, child.port, child.env)
        child.restarts += 1
        delay = min(delay * 2, MAX_RESTART_DELAY_S)


async def wait_ready(
    children: list[Child], timeout_s: float, tls: TlsSettings | None = None
) -> dict[str, float | None]:
    """Each service's cold start: seconds from its start to readiness (the seed's
    cold_start_time), or None for one that did not become ready (or died) in time."""
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def one(child: Child) -> float | None:
        ready = asyncio.create_task(
            wait_until_serving(child.target, child.spec.name, timeout_s, interval_s=0.1, tls=tls)
        )
        died = asyncio.create_task(child.process.wait())
        await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
        died.cancel()
        if not ready.done():
            ready.cancel()
            return None
        return loop.time() - began if ready.result() else None

    results = await asyncio.gather(*(one(child) for child in children))
    return {child.spec.name: took for child, took in zip(children, results, strict=True)}


async def stop(children: list[Child], grace_s: float) -> None:
    """SIGTERM everyone, wait for their drains, SIGKILL what is left after the grace period."""
    for child in children:
        if child.process.returncode is None:
            child.process.send_signal(signal.SIGTERM)
    waits = [asyncio.create_task(child.process.wait()) for child in children]
    _, pending = await asyncio.wait(waits, timeout=grace_s) if waits else (set(), set())
    for child in children:
        if child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
    if pending:
        await asyncio.wait(pending)


async def until_signal_or_exit(
    children: list[Child], *others: asyncio.subprocess.Process, on_restart: OnRestart
) -> None:
    """Runs until SIGINT/SIGTERM, restarting any child that exits meanwhile; returns at
    once if one of `others` (the edge proxy, which has no supervisor here) exits."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    keepers = [asyncio.create_task(keep_running(child, on_restart)) for child in children]
    watchers = {asyncio.create_task(process.wait()) for process in others}
    watchers.add(asyncio.create_task(stop_requested.wait()))
    try:
        await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in [*keepers, *watchers]:
            task.cancel()
        await asyncio.gather(*keepers, *watchers, return_exceptions=True)
