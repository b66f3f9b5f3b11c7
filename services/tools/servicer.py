"""The tools service's gRPC surface: list tools, validate arguments, run with limits."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format

from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh.failures import NotFound
from mesh.server import MeshServer
from mesh.validation import Violations
from services.tools.builtin import BUILTIN
from services.tools.idempotency import MAX_KEY_BYTES, IdempotencyKeys
from services.tools.runner import run_tool
from services.tools.schema import check_arguments
from services.tools.settings import ToolsSettings, tools_settings, wrapped_targets
from services.tools.tool import ToolContext, ToolDefinition

SERVICE = tools_pb2.DESCRIPTOR.services_by_name["ToolsService"]
PAGE_SIZE = 50


def describe(tool: ToolDefinition, settings: ToolsSettings) -> tools_pb2.Tool:
    return tools_pb2.Tool(
        name=tool.name,
        title=tool.title,
        description=tool.description,
        input_schema=tool.input_schema,
        output_schema=tool.output_schema,
        annotations=tool.annotations,
        timeout_ms=int(settings.limits(tool.name, tool.timeout_s, tool.idle_timeout_s)[0] * 1000),
    )


class ToolsServicer(tools_pb2_grpc.ToolsServiceServicer):
    def __init__(self, context: ToolContext, tools: tuple[ToolDefinition, ...]) -> None:
        self.context = context
        self.tools = {tool.name: tool for tool in tools}
        self.keys = IdempotencyKeys(context.settings.idempotency_window_s)

    async def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListToolsResponse:
        violations = Violations()
        start = int(request.cursor) if request.cursor.isdigit() else -1
        violations.check(
            request.cursor == "" or 0 <= start <= len(self.tools),
            "cursor",
            "must be a next_cursor this service returned",
        )
        violations.raise_if_any()
        start = max(start, 0)
        names = sorted(self.tools)[start : start + PAGE_SIZE]
        end = start + len(names)
        return tools_pb2.ListToolsResponse(
            tools=[describe(self.tools[name], self.context.settings) for name in names],
            next_cursor=str(end) if end < len(self.tools) else "",
        )

    async def CallTool(
        self, request: tools_pb2.CallToolRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tools_pb2.CallToolResponse]:
        violations = Violations()
        violations.check(bool(request.name), "name", "must name a tool from ListTools")
        violations.max_length(request.idempotency_key.encode(), "idempotency_key", MAX_KEY_BYTES)
        violations.raise_if_any()
        tool = self.tools.get(request.name)
        if tool is None:
            raise NotFound(
                f"no tool {request.name!r}; known: {', '.join(sorted(self.tools))}",
                resource_type="tool",
                resource_name=request.name,
            )
        arguments = json_format.MessageToDict(request.arguments)
        check_arguments(tool.input_schema, arguments).raise_if_any()
        if not request.idempotency_key:
            async for message in self._run(tool, arguments):
                yield message
            return
        call = json.dumps([tool.name, arguments], sort_keys=True)
        while (earlier := self.keys.claim(request.idempotency_key, call)) is not None:
            result = await earlier.result
            if result is not None:
                yield tools_pb2.CallToolResponse(result=result)
                return
        result = None
        try:
            async for message in self._run(tool, arguments):
                if message.HasField("result") and not message.result.is_error:
                    result = message.result
                yield message
        finally:
            self.keys.settle(request.idempotency_key, result)

    def _run(self, tool: ToolDefinition, arguments: dict) -> AsyncIterator:
        limit, idle = self.context.settings.limits(tool.name, tool.timeout_s, tool.idle_timeout_s)
        return run_tool(tool, arguments, self.context, timeout_s=limit, idle_timeout_s=idle)


async def setup(server: MeshServer) -> None:
    settings = tools_settings(server.settings)
    context = ToolContext(server.channels, settings, wrapped_targets(server.settings, settings))
    server.add_service(
        tools_pb2_grpc.add_ToolsServiceServicer_to_server,
        ToolsServicer(context, BUILTIN),
        SERVICE,
    )
