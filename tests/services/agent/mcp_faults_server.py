"""A scripted MCP server (the official SDK's low-level Server, over stdio) for the agent's
fault tests: tools that answer, hang, return 10 MB, fail, or kill their own process, and
one whose input schema is invalid. Run as `python -m tests.services.agent.mcp_faults_server`."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

ECHO_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
NO_ARGUMENTS = {"type": "object", "properties": {}}
TOOLS = [
    types.Tool(name="echo", description="Says the text back.", input_schema=ECHO_SCHEMA),
    types.Tool(name="hang", description="Never answers.", input_schema=NO_ARGUMENTS),
    types.Tool(name="huge", description="Returns 10 MB of text.", input_schema=NO_ARGUMENTS),
    types.Tool(name="fail", description="Fails as a tool.", input_schema=NO_ARGUMENTS),
    types.Tool(name="die", description="Kills this server.", input_schema=NO_ARGUMENTS),
    types.Tool(
        name="broken",
        description="Its schema is not a JSON Schema.",
        input_schema={"type": "object", "properties": {"x": {"type": 7}}},
    ),
    types.Tool(name="not.a.function", description="A dotted name.", input_schema=NO_ARGUMENTS),
]


async def list_tools(
    ctx: Any, params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    arguments = params.arguments or {}
    if params.name == "echo":
        text = f"pid {os.getpid()}: {arguments['text']}"
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])
    if params.name == "hang":
        await asyncio.Event().wait()
    if params.name == "huge":
        text = "x" * (10 * 1024 * 1024)
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])
    if params.name == "die":
        os._exit(1)
    text = "the tool could not do it"
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


async def main() -> None:
    server: Server[Any] = Server("faults", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
