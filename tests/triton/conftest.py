"""A real Triton Inference Server serving aimesh's model repository, each model's
artifact linked in (loadtest/triton_server.py starts it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from loadtest.triton_server import TritonServer, prepare_repository, triton_venv
from mesh.config import MeshSettings
from tests.conftest import free_port


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < give_up, f"not within {timeout_s} s"
        await asyncio.sleep(0.2)


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    return prepare_repository(
        tmp_path_factory.mktemp("triton") / "models", MeshSettings().cache_dir
    )


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def triton(model_repository, tmp_path_factory) -> AsyncIterator[TritonServer]:
    venv = await asyncio.to_thread(triton_venv)
    server = TritonServer(
        venv, model_repository, tmp_path_factory.mktemp("triton-run"), free_port()
    )
    server.start()
    try:
        await server.wait_all_ready()
        yield server
    finally:
        server.stop()
