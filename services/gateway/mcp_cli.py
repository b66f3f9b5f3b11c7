"""`aimesh mcp`: the mesh's tools as an MCP server on stdin and stdout, for a client
that launches its servers (Claude Desktop, Cursor, the MCP Inspector, an agent SDK's
stdio transport). The same server as the gateway's /mcp (mcp_server.py); its calls go
to the tools service, or through the edge with a key. The key comes from the
environment, as MCP asks of stdio servers, never from the command line (where `ps`
shows it): AIMESH_API_KEY, sent as `authorization: Bearer` with every call.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Any

import typer
from mcp.server.stdio import stdio_server

from aimesh.tools.v1 import tools_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.registry import discover
from services.gateway.mcp_server import TOOLS, Metadata, ToolsOverMcp

KEY_VARIABLE = "AIMESH_API_KEY"


def mcp(
    target: Annotated[
        str | None,
        typer.Option(
            help="host:port of the tools service, or of the edge (with AIMESH_API_KEY); "
            "default: the tools service's configured address"
        ),
    ] = None,
    call_timeout_s: Annotated[
        float, typer.Option(min=0.1, help="the longest one tools/list or tools/call may take")
    ] = 600.0,
) -> None:
    """Serve the mesh's tools to an MCP client over stdin and stdout."""
    settings = MeshSettings()
    if target is None:
        target = settings.target_of("tools", discover()["tools"].default_port)
    key = os.environ.get(KEY_VARIABLE, "")
    metadata: Metadata = [("authorization", f"Bearer {key}")] if key else []
    asyncio.run(_serve(target, settings, metadata, call_timeout_s))


async def _serve(
    target: str, settings: MeshSettings, metadata: Metadata, call_timeout_s: float
) -> None:
    def same_for_every_request(_: Any) -> Metadata:
        return metadata

    async with create_channel(target, settings, services=[TOOLS]) as channel:
        server = ToolsOverMcp(
            tools_pb2_grpc.ToolsServiceStub(channel),
            call_timeout_s=call_timeout_s,
            metadata=same_for_every_request,
        ).server
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
