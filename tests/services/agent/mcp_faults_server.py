"""A scripted MCP server (the official SDK's low-level Server, over stdio) for the agent's
fault tests: tools that answer, hang, return 10 MB, fail, or kill their own process, one
whose input schema is invalid, and one that adds a tool and says the list changed (to
listeners at 2026-07-28, as a notification earlier). Run as
`python -m tests.services.agent.mcp_faults_server`."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.stdio import stdio_server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged

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
    types.Tool(name="grow", description="Adds the tool `grown`.", input_schema=NO_ARGUMENTS),
]
CHANGES = InMemorySubscriptionBus()


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
    if params.name == "grow":
        TOOLS.append(types.Tool(name="grown", description="New.", input_schema=NO_ARGUMENTS))
        await CHANGES.publish(ToolsListChanged())
        with contextlib.suppress(Exception):  # no standing channel at 2026-07-28
            await ctx.session.send_tool_list_changed()
        return types.CallToolResult(content=[types.TextContent(type="text", text="grown")])
    text = "the tool could not do it"
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


async def main() -> None:
    server: Server[Any] = Server(
        "faults",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_subscriptions_listen=ListenHandler(CHANGES),
    )
    options = server.create_initialization_options(NotificationOptions(tools_changed=True))
    async with stdio_server() as (read, write):
        await server.run(read, write, options)


if __name__ == "__main__":
    anyio.run(main)
