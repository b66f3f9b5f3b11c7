"""A fault-injecting TCP proxy for the chaos suite (`loadtest/chaos.py`), toxiproxy-style.

toxiproxy installs neither from pip nor from Debian here, so this is a small asyncio one:
listen on 127.0.0.1:port, forward bytes to an upstream 127.0.0.1:port, and change what
happens to them while it runs. It is byte-transparent, so it works for gRPC (HTTP/2 over
TCP) without understanding it. Modes:

- `pass`: forward everything.
- `latency(ms)`: deliver each chunk `ms` after it arrived, in order, both directions.
- `reset`: abort every open connection with an RST (SO_LINGER 0) and answer every new one
  with an RST right after accepting it: a peer that crashed, or a host that refuses.
- `blackhole`: accept, read and discard, forward nothing: a partition. A connection that
  lost bytes this way has a hole in its byte stream that cannot be resumed (a real network
  would retransmit), so when the blackhole ends it is reset, as TCP would give up on it
  after a long enough partition; new connections then go through.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field
from enum import Enum

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024
QUEUED_CHUNKS = 16  # per direction: what the proxy holds for a peer that reads slowly


class Mode(Enum):
    PASS = "pass"
    LATENCY = "latency"
    RESET = "reset"
    BLACKHOLE = "blackhole"


def abort(writer: asyncio.StreamWriter) -> None:
    """Closes the connection with an RST instead of a FIN, so the peer sees a crash
    (ECONNRESET), not an orderly end of stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    holed: bool = False  # bytes were discarded by a blackhole
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                abort(writer)
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """One proxied edge; switch faults with `set_pass()`, `set_latency(ms)`, `set_reset()`
    and `set_blackhole()` from the same event loop while traffic flows."""

    def __init__(self, upstream_port: int, port: int = 0, host: str = LOOPBACK) -> None:
        self.upstream_port = upstream_port
        self.host = host
        self.port = port
        self.mode = Mode.PASS
        self.latency_s = 0.0
        self.accepted = 0
        self.reset_connections = 0
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stops listening and resets every connection; returns once their handlers ended."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.abort()
        self._connections.clear()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def set_pass(self) -> None:
        self._switch(Mode.PASS)

    def set_latency(self, ms: float) -> None:
        self.latency_s = ms / 1000
        self._switch(Mode.LATENCY)

    def set_reset(self) -> None:
        self._switch(Mode.RESET)
        for connection in list(self._connections):
            self._drop(connection)

    def set_blackhole(self) -> None:
        self._switch(Mode.BLACKHOLE)

    def _switch(self, mode: Mode) -> None:
        if self.mode is Mode.BLACKHOLE and mode is not Mode.BLACKHOLE:
            for connection in [c for c in self._connections if c.holed]:
                self._drop(connection)
        self.mode = mode

    def _drop(self, connection: _Connection) -> None:
        self.reset_connections += 1
        self._connections.discard(connection)
        connection.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        self.accepted += 1
        if self.mode is Mode.RESET:
            self.reset_connections += 1
            abort(writer)
            return
        connection = _Connection(writer)
        self._connections.add(connection)
        if self.mode is Mode.BLACKHOLE:
            connection.holed = True
            await self._discard(reader)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        except OSError:
            # Upstream refuses: so does the proxy, with the same RST a refusal would cause.
            self._drop(connection)
            return
        if connection not in self._connections:  # reset while connecting
            abort(up_writer)
            return
        connection.upstream = up_writer
        connection.tasks = [
            asyncio.create_task(self._pump(connection, reader, up_writer)),
            asyncio.create_task(self._pump(connection, up_reader, writer)),
        ]
        await asyncio.gather(*connection.tasks, return_exceptions=True)
        if connection in self._connections:
            self._connections.discard(connection)
            for side in (writer, up_writer):
                side.close()

    async def _discard(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while await reader.read(CHUNK):
                pass

    async def _pump(
        self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copies one direction; a queue between reading and writing lets latency delay
        every chunk by the same amount without slowing the stream's throughput, and its
        bound keeps TCP's backpressure: a peer that stops reading stops the sender too."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=QUEUED_CHUNKS)

        def delay() -> float:
            return self.latency_s if self.mode is Mode.LATENCY else 0.0

        async def receive() -> None:
            while data := await reader.read(CHUNK):
                if self.mode is Mode.BLACKHOLE:
                    connection.holed = True
                else:
                    await queue.put((loop.time() + delay(), data))
            await queue.put((loop.time() + delay(), b""))

        async def send() -> None:
            while data := (item := await queue.get())[1]:
                if item[0] > loop.time():
                    await asyncio.sleep(item[0] - loop.time())
                writer.write(data)
                await writer.drain()

        halves = [asyncio.create_task(receive()), asyncio.create_task(send())]
        try:
            # Until everything read has been sent, or either half fails.
            await asyncio.wait(halves, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for half in halves:
                half.cancel()
            await asyncio.gather(*halves, return_exceptions=True)
            # One direction ended: end the other too (gRPC never half-closes a connection).
            for task in connection.tasks:
                if task is not asyncio.current_task():
                    task.cancel()
