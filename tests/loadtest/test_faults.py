"""The chaos suite's faults: the fault proxy against a TCP echo server (each mode does to a
byte stream what the network fault it stands for does, and traffic flows again when the
fault ends); the store faults (a SQLite file that refuses writes while its lock is held
elsewhere; a redis-server killed -9 and started again keeps what it acknowledged)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from loadtest.chaos_mesh import RedisProcess, sqlite_write_lock
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


def test_a_held_sqlite_write_lock_fails_writes_and_lets_reads_through(tmp_path) -> None:
    path = tmp_path / "store.sqlite3"
    db = sqlite3.connect(path, isolation_level=None, timeout=0.2)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (n INTEGER)")
    db.execute("INSERT INTO t VALUES (1)")
    with sqlite_write_lock(path):
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            db.execute("INSERT INTO t VALUES (2)")
        assert db.execute("SELECT count(*) FROM t").fetchone() == (1,)
    db.execute("INSERT INTO t VALUES (3)")
    assert db.execute("SELECT n FROM t ORDER BY n").fetchall() == [(1,), (3,)]
    db.close()


@pytest.mark.service  # a real redis-server
def test_a_redis_killed_and_started_again_keeps_what_it_acknowledged(tmp_path) -> None:
    import redis

    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=1)
        client.set("acknowledged", "yes")
        server.kill()
        with pytest.raises(redis.ConnectionError):
            client.get("acknowledged")
        server.start()
        assert client.get("acknowledged") == b"yes"
        client.close()
    finally:
        server.kill()
