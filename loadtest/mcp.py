"""MCP benchmark: one tool call straight to the tools service over gRPC, against the same
call over MCP (the gateway's /mcp at both protocol revisions, and `aimesh mcp` over
stdio), in one run.

The tools service and the gateway run as `aimesh serve` processes on loopback (the
gateway without a key file); the client is the official SDK's, one call in flight, the
calculator on a short expression, so the figures are each path's own cost around a tool
that takes well under a millisecond. The ways alternate round by round, so that drift on
a busy machine hits each alike.

    python -m loadtest.mcp --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import IO

import httpx
from grpc import aio
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from loadtest.chaos_mesh import free_port
from loadtest.mesh_overhead import write

BEGIN, END = "<!-- mcp:begin -->", "<!-- mcp:end -->"
ARGUMENTS = {"expression": "17 * 23"}
CALLS_PER_ROUND = 20
Call = Callable[[], Awaitable[None]]


@asynccontextmanager
async def services() -> AsyncIterator[tuple[str, str]]:
    """`aimesh serve tools` and `aimesh serve gateway`; the tools target and /mcp's URL."""
    tools_port, gateway_port, http_port = free_port(), free_port(), free_port()
    dead = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "AIMESH_SERVICES__TOOLS__METRICS_PORT": "0",
        "AIMESH_SERVICES__TOOLS__DEPENDENCIES__RETRIEVAL": dead,
        "AIMESH_SERVICES__TOOLS__DEPENDENCIES__DIFFUSION": dead,
        "AIMESH_SERVICES__GATEWAY__METRICS_PORT": "0",
        "AIMESH_SERVICES__GATEWAY__HTTP_PORT": str(http_port),
        "AIMESH_SERVICES__GATEWAY__DEPENDENCIES__TOOLS": f"127.0.0.1:{tools_port}",
    }
    with tempfile.TemporaryFile() as log:
        processes = _serve({"tools": tools_port, "gateway": gateway_port}, env, log)
        try:
            url = f"http://127.0.0.1:{http_port}/mcp"
            await _wait_for(f"http://127.0.0.1:{http_port}/health/live")
            yield f"127.0.0.1:{tools_port}", url
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)


def _serve(ports: dict[str, int], env: dict[str, str], log: IO[bytes]) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "mesh.cli", "serve", name, "--port", str(port)],
            env=env,
            stdout=log,
            stderr=log,
        )
        for name, port in ports.items()
    ]


async def _wait_for(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s")


async def ways(stack: AsyncExitStack, target: str, url: str) -> dict[str, Call]:
    """Each way to make the call, connected once (a client keeps its connection)."""
    channel = await stack.enter_async_context(aio.insecure_channel(target))
    stub = tools_pb2_grpc.ToolsServiceStub(channel)
    request = tools_pb2.CallToolRequest(name="calculator")
    request.arguments.update(ARGUMENTS)

    async def grpc_call() -> None:
        async for message in stub.CallTool(request, timeout=30):
            assert not message.HasField("result") or not message.result.is_error

    calls: dict[str, Call] = {"gRPC CallTool (direct)": grpc_call}
    for name, mode in (
        ("MCP HTTP /mcp, 2026-07-28", "2026-07-28"),
        ("MCP HTTP /mcp, 2025-11-25", "legacy"),
    ):
        http = await stack.enter_async_context(create_mcp_http_client())
        client = await stack.enter_async_context(
            Client(streamable_http_client(url, http_client=http), mode=mode)
        )
        calls[name] = _mcp_call(client)
    stdio = StdioServerParameters(
        command=sys.executable, args=["-m", "mesh.cli", "mcp", "--target", target]
    )
    calls["MCP stdio, `aimesh mcp`"] = _mcp_call(await stack.enter_async_context(Client(stdio)))
    return calls


def _mcp_call(client: Client) -> Call:
    async def call() -> None:
        result = await client.call_tool("calculator", ARGUMENTS)
        assert not result.is_error

    return call


async def rows(rounds: int) -> list[str]:
    async with services() as (target, url), AsyncExitStack() as stack:
        calls = await ways(stack, target, url)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():  # warm: connections, the SDK's first-call work
            await call()
        for _ in range(rounds):
            for name, call in calls.items():
                for _ in range(CALLS_PER_ROUND):
                    started = time.perf_counter()
                    await call()
                    samples[name].append(time.perf_counter() - started)
    direct = statistics.median(samples["gRPC CallTool (direct)"])
    table = []
    for name, taken in samples.items():
        p50 = statistics.median(taken)
        p95 = statistics.quantiles(taken, n=20)[-1]
        table.append(f"| {name} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} | {p50 / direct:.1f}x |")
    return table


def report(table: list[str], rounds: int, command: str) -> str:
    return "\n".join(
        [
            BEGIN,
            "## MCP: a tool call over gRPC against the same call over MCP",
            "",
            f"`{command}` on {platform.machine()}, Python {platform.python_version()}: "
            "`aimesh serve tools` and `aimesh serve gateway` on loopback, the official MCP "
            f"SDK's client (one call in flight), the calculator on `17 * 23`, {rounds} "
            f"rounds of {CALLS_PER_ROUND} calls a way, the ways alternated. Each MCP call is "
            "a ToolsService call inside, so the difference is the MCP front's own cost "
            "(JSON-RPC, the SDK's validation, HTTP and SSE, or stdio's pipes). Timings on a "
            "noisy 2-core machine: read the ratios.",
            "",
            "| way | p50 (ms) | p95 (ms) | p50 vs direct |",
            "|---|---|---|---|",
            *table,
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    table = asyncio.run(rows(args.rounds))
    markdown = report(table, args.rounds, "python -m loadtest.mcp")
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
