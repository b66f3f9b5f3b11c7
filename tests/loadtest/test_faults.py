"""The chaos suite's fault proxy against a TCP echo server: each mode does to a byte stream
what the network fault it stands for does, and traffic flows again when the fault ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from loadtest.faults import FaultProxy

pytestmark = pytest.mark.unit

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
BROKEN = (ConnectionResetError, asyncio.IncompleteReadError)


@dataclass
class Edge:
    """An echo server behind a proxy; remembers every socket so teardown leaves none open."""

    proxy: FaultProxy
    clients: list[asyncio.StreamWriter] = field(default_factory=list)
    echoes: set[asyncio.Task[None]] = field(default_factory=set)

    async def echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.echoes.add(task)
        try:
            while data := await reader.read(4096):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def connect(self) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.proxy.port)
        self.clients.append(writer)
        return reader, writer


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    edge = Edge(FaultProxy(0))
    server = await asyncio.start_server(edge.echo, "127.0.0.1", 0)
    edge.proxy.upstream_port = server.sockets[0].getsockname()[1]
    await edge.proxy.start()
    yield edge
    for writer in edge.clients:
        writer.close()
    await edge.proxy.close()
    server.close()
    await server.wait_closed()
    await asyncio.gather(*edge.echoes, return_exceptions=True)


async def round_trip(connection: Connection, payload: bytes, timeout_s: float = 1.0) -> bytes:
    reader, writer = connection
    writer.write(payload)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(payload)), timeout_s)


async def test_pass_forwards_bytes_both_ways(edge: Edge) -> None:
    connection = await edge.connect()
    assert await round_trip(connection, b"hello") == b"hello"
    big = bytes(range(256)) * 1024
    assert await round_trip(connection, big) == big


async def test_latency_delays_each_direction_and_can_be_lifted(edge: Edge) -> None:
    connection = await edge.connect()
    edge.proxy.set_latency(150)
    started = time.monotonic()
    assert await round_trip(connection, b"slow") == b"slow"
    assert time.monotonic() - started >= 0.3  # 150 ms there, 150 ms back
    edge.proxy.set_pass()
    started = time.monotonic()
    assert await round_trip(connection, b"fast") == b"fast"
    assert time.monotonic() - started < 0.15


async def test_reset_aborts_open_connections_and_refuses_new_ones(edge: Edge) -> None:
    connection = await edge.connect()
    await round_trip(connection, b"before")
    edge.proxy.set_reset()
    with pytest.raises(BROKEN):
        await round_trip(connection, b"after")
    with pytest.raises(BROKEN):
        await round_trip(await edge.connect(), b"new")
    edge.proxy.set_pass()
    assert await round_trip(await edge.connect(), b"back") == b"back"


async def test_blackhole_swallows_bytes_then_resets_what_it_cut(edge: Edge) -> None:
    cut = await edge.connect()
    await round_trip(cut, b"before")
    edge.proxy.set_blackhole()
    with pytest.raises(TimeoutError):
        await round_trip(cut, b"lost", timeout_s=0.3)
    during = await edge.connect()  # the handshake completes; nothing else does
    with pytest.raises(TimeoutError):
        await round_trip(during, b"lost too", timeout_s=0.3)
    edge.proxy.set_pass()
    for connection in (cut, during):
        with pytest.raises(BROKEN):
            await round_trip(connection, b"resumed?")
    assert await round_trip(await edge.connect(), b"healed") == b"healed"
