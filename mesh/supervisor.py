"""`aimesh up`: every service in its own process, on its own port, over real loopback gRPC.

The supervisor starts `aimesh serve NAME` per service, waits until each answers readiness,
and on Ctrl-C or SIGTERM passes SIGTERM on so every service drains its in-flight calls,
killing only what outlives its grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from mesh.registry import ServiceSpec


@dataclass
class Child:
    spec: ServiceSpec
    target: str
    process: asyncio.subprocess.Process


async def start(spec: ServiceSpec, settings: MeshSettings, log_file: Path | None) -> Child:
    # One process per service, so one trace resource name per service.
    env = {**os.environ, "OTEL_SERVICE_NAME": f"aimesh-{spec.name}"}
    stderr = None if log_file is None else log_file.open("ab")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh.cli", "serve", spec.name, env=env, stderr=stderr
    )
    if stderr is not None:
        stderr.close()
    return Child(spec, settings.target_of(spec.name, spec.default_port), process)


async def wait_ready(children: list[Child], timeout_s: float) -> list[str]:
    """Names of the services that did not become ready (or died) within the timeout."""

    async def one(child: Child) -> bool:
        ready = asyncio.create_task(wait_until_serving(child.target, child.spec.name, timeout_s))
        died = asyncio.create_task(child.process.wait())
        await asyncio.wait({ready, died}, return_when=asyncio.FIRST_COMPLETED)
        died.cancel()
        if not ready.done():
            ready.cancel()
            return False
        return ready.result()

    results = await asyncio.gather(*(one(child) for child in children))
    return [child.spec.name for child, ok in zip(children, results, strict=True) if not ok]


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


async def until_signal_or_exit(children: list[Child], *others: asyncio.subprocess.Process) -> None:
    """Returns on SIGINT/SIGTERM, or as soon as any child (or other process) exits."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    processes = [child.process for child in children] + list(others)
    watchers = {asyncio.create_task(process.wait()) for process in processes}
    watchers.add(asyncio.create_task(stop_requested.wait()))
    _, pending = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
