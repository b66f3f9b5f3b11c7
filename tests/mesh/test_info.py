"""GetInfo: every process says what it runs, also while it is still loading."""

from __future__ import annotations

import asyncio

import pytest

from mesh.config import MeshSettings
from mesh.info import ModelInfo, get_info, summary
from mesh.server import MeshServer
from services.echo.servicer import setup as echo_setup
from tests.conftest import eventually, target

pytestmark = pytest.mark.service


async def test_info_answers_while_loading_and_lists_what_was_described():
    server = MeshServer("echo", MeshSettings(), port=0)
    await echo_setup(server)
    loaded = asyncio.Event()
    model = ModelInfo(
        name="SmolLM2-135M-Instruct",
        sha256="ab" * 32,
        dtype="float32",
        device="cpu",
        engine="torch",
        limits={"max_context_tokens": "8192"},
    )

    async def load() -> None:
        await loaded.wait()
        server.describe(model)

    server.add_warmup(load)
    starting = asyncio.create_task(server.start())
    try:
        await eventually(lambda: server.port != 0)
        during = await get_info(target(server), timeout_s=5)
        assert during is not None
        assert (during.service, during.loaded, list(during.models)) == ("echo", False, [])
        assert during.version  # the installed package's version
        loaded.set()
        await asyncio.wait_for(starting, 10)
        after = await get_info(target(server), timeout_s=5)
        assert after.loaded and list(after.models) == [model]
        assert summary(after.models[0]) == "SmolLM2-135M-Instruct float32 cpu torch"
    finally:
        loaded.set()
        await server.drain(0)


async def test_info_of_nothing_listening_is_none():
    assert await get_info("127.0.0.1:1", timeout_s=1) is None
