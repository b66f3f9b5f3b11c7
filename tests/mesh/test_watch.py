"""Watched background tasks: a process whose scheduler died says so and exits."""

from __future__ import annotations

import asyncio
import time

import grpc
import psutil
import pytest
from prometheus_client import REGISTRY

from aimesh.echo.v1 import echo_pb2
from mesh.config import MeshSettings
from mesh.errors import error_info
from mesh.failures import NotReady
from mesh.health import probe
from mesh.server import BROKEN_EXIT_STATUS, MeshServer
from services.echo.servicer import setup as echo_setup
from tests.conftest import echo_stub, eventually, target

pytestmark = pytest.mark.service


async def _dies_when(event: asyncio.Event) -> None:
    await event.wait()
    raise RuntimeError("scheduler bug")


async def test_a_dead_watched_task_flips_liveness_and_readiness_and_fails_its_waiters(
    echo_server,
):
    server = await echo_server()
    assert await probe(target(server), "echo") == "SERVING"
    trigger = asyncio.Event()
    failed: list[BaseException] = []
    server.watch(asyncio.create_task(_dies_when(trigger), name="scheduler"), failed.append)
    trigger.set()
    await asyncio.wait_for(server.broken.wait(), 10)
    assert len(failed) == 1 and isinstance(failed[0], NotReady)
    assert "scheduler" in str(failed[0])
    assert await probe(target(server), "") == "NOT_SERVING"
    assert await probe(target(server), "echo") == "NOT_SERVING"
    stub, channel = echo_stub(server)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Echo(echo_pb2.EchoRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(caught.value).reason == "NOT_READY"
    assert "broken" in caught.value.details()


async def test_calls_before_the_warm_ups_end_are_not_ready_without_a_servicer_guard():
    server = MeshServer("echo", MeshSettings(), port=0)
    await echo_setup(server)
    loaded = asyncio.Event()
    server.add_warmup(loaded.wait)
    starting = asyncio.create_task(server.start())
    try:
        await eventually(lambda: server.port != 0)
        stub, channel = echo_stub(server)
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.EchoStream(echo_pb2.EchoStreamRequest(count=1), timeout=5).read()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(caught.value).reason == "NOT_READY"
            assert "still loading" in caught.value.details()
            loaded.set()
            await asyncio.wait_for(starting, 10)
            await stub.Echo(echo_pb2.EchoRequest(), timeout=5)
    finally:
        loaded.set()
        await server.drain(0)


async def test_a_task_cancelled_by_drain_is_no_death(echo_server):
    server = await echo_server()
    task = asyncio.create_task(asyncio.Event().wait(), name="poller")
    server.watch(task)
    await server.drain(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not server.broken.is_set()


async def test_a_task_its_owner_unwatched_and_ended_is_no_death(echo_server):
    server = await echo_server()
    task = asyncio.create_task(asyncio.Event().wait(), name="version-load-poll")
    server.watch(task)
    server.unwatch(task)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not server.broken.is_set()
    assert await probe(target(server), "") == "SERVING"


async def test_the_cold_start_is_the_time_from_process_start_to_ready(echo_server):
    await echo_server()
    since_start = time.time() - psutil.Process().create_time()
    assert 0 < REGISTRY.get_sample_value("aimesh_cold_start_seconds") <= since_start


async def test_serving_ends_with_a_failure_status_after_a_watched_task_died():
    """`aimesh serve` exits with this status, so `aimesh up` or Kubernetes restarts it."""
    server = MeshServer("echo", MeshSettings(), port=0)
    await echo_setup(server)
    trigger = asyncio.Event()

    async def start_watched() -> None:
        server.watch(asyncio.create_task(_dies_when(trigger), name="scheduler"))

    server.add_warmup(start_watched)
    serving = asyncio.create_task(server.serve_until_signal())
    await asyncio.sleep(0.2)
    assert not serving.done()
    trigger.set()
    assert await asyncio.wait_for(serving, 30) == BROKEN_EXIT_STATUS


async def test_the_runtime_owns_an_engines_threads_and_stops_them_after_the_drain():
    server = MeshServer("echo", MeshSettings(), port=0)
    await echo_setup(server)
    threads = server.executor("model", 2)
    await server.start()
    assert await asyncio.get_running_loop().run_in_executor(threads, lambda: 42) == 42
    await server.drain(0)
    with pytest.raises(RuntimeError, match="shutdown"):
        threads.submit(lambda: None)
