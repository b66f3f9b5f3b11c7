"""The mesh's tools as an MCP server, whatever carries it: the SDK's low-level Server
whose tools/list and tools/call are ToolsService calls over the mesh, so validation,
time limits, idempotency and tenancy stay the tools service's own (one implementation
underneath, each transport a thin front: /mcp over HTTP, `aimesh mcp` over stdio).

A call's Progress becomes notifications/progress when the client asked for it (a
progressToken); a client that cancels cancels the gRPC call, and so the tool. A tool's
own failure is a result with isError, for the model to read; an unknown tool, arguments
its schema refuses or a bad cursor are INVALID_PARAMS naming the field; the tools
service out of reach is INTERNAL_ERROR.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from mcp import types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh.errors import field_violations

TOOLS = tools_pb2.DESCRIPTOR.services_by_name["ToolsService"]
# Codes the tools service answers for the caller's mistakes: the MCP client's to fix.
_CALLERS_MISTAKES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
# What a transport says of a request: the metadata its ToolsService call carries (the
# tenant, a request id, a key).
Metadata = Sequence[tuple[str, str]]


def mcp_tool(tool: tools_pb2.Tool) -> types.Tool:
    """A ToolsService tool as MCP lists it. The service sets every hint, so each is
    sent (MCP's defaults, destructive and open-world when absent, would say otherwise)."""
    hints = tool.annotations
    return types.Tool(
        name=tool.name,
        title=tool.title or None,
        description=tool.description,
        input_schema=json_format.MessageToDict(tool.input_schema),
        output_schema=(
            json_format.MessageToDict(tool.output_schema)
            if tool.HasField("output_schema")
            else None
        ),
        annotations=types.ToolAnnotations(
            title=tool.title or None,
            read_only_hint=hints.read_only,
            idempotent_hint=hints.idempotent,
            destructive_hint=hints.destructive,
            open_world_hint=hints.open_world,
        ),
    )


def mcp_result(result: tools_pb2.CallToolResult) -> types.CallToolResult:
    """A ToolsService result as MCP returns it: text blocks, images as base64, the
    structured content where the tool gives one."""
    content: list[types.TextContent | types.ImageContent] = []
    for block in result.content:
        if block.HasField("image"):
            data = base64.b64encode(block.image.data).decode("ascii")
            content.append(
                types.ImageContent(type="image", data=data, mime_type=block.image.mime_type)
            )
        else:
            content.append(types.TextContent(type="text", text=block.text))
    structured = (
        json_format.MessageToDict(result.structured_content)
        if result.HasField("structured_content")
        else None
    )
    return types.CallToolResult(
        content=content, structured_content=structured, is_error=result.is_error
    )


class ToolsOverMcp:
    """tools/list and tools/call over a ToolsService stub; `metadata(ctx)` says, per
    request, what each call carries."""

    def __init__(
        self,
        tools: tools_pb2_grpc.ToolsServiceStub,
        *,
        call_timeout_s: float,
        metadata: Callable[[Any], Metadata],
    ) -> None:
        self._tools = tools
        self._call_timeout_s = call_timeout_s
        self._metadata = metadata
        self.server: Server[Any] = Server(
            "aimesh-tools",
            version="0.1.0",
            instructions="The aimesh mesh's tools: knowledge search, images, arithmetic.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    async def _list_tools(
        self, ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        cursor = (params.cursor if params else None) or ""
        try:
            listed = await self._tools.ListTools(
                tools_pb2.ListToolsRequest(cursor=cursor),
                metadata=self._metadata(ctx),
                timeout=self._call_timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            raise _mcp_error(error) from None
        return types.ListToolsResult(
            tools=[mcp_tool(tool) for tool in listed.tools],
            next_cursor=listed.next_cursor or None,
        )

    async def _call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        request = tools_pb2.CallToolRequest(name=params.name)
        try:
            request.arguments.update(params.arguments or {})
        except (ValueError, TypeError) as error:  # not representable: Struct's own bounds
            raise MCPError(types.INVALID_PARAMS, f"arguments: {error}") from None
        call = self._tools.CallTool(
            request, metadata=self._metadata(ctx), timeout=self._call_timeout_s
        )
        try:
            async for message in call:
                if message.HasField("result"):
                    return mcp_result(message.result)
                progress = message.progress
                await ctx.session.report_progress(
                    progress.progress,
                    progress.total if progress.HasField("total") else None,
                    progress.message or None,
                )
        except grpc.aio.AioRpcError as error:
            raise _mcp_error(error) from None
        finally:
            call.cancel()  # a no-op once the call ended; else the tool stops now
        raise MCPError(types.INTERNAL_ERROR, "the tools service ended the call without a result")


def _mcp_error(error: grpc.aio.AioRpcError) -> MCPError:
    """The tools service's refusal as MCP's error: the caller's mistakes (unknown tool,
    arguments the schema refuses, a bad cursor) are INVALID_PARAMS with the fields
    named; anything else is the server's."""
    if error.code() in _CALLERS_MISTAKES:
        violations = [
            {"field": v.field, "description": v.description} for v in field_violations(error)
        ]
        return MCPError(types.INVALID_PARAMS, error.details() or "", violations or None)
    return MCPError(
        types.INTERNAL_ERROR, f"the tools service failed: {error.code().name}: {error.details()}"
    )
