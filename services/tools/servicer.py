"""The tools service's gRPC surface: list tools, validate arguments, run with limits."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator

import grpc

from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh import caller, request_id
from mesh.failures import FieldViolation, InvalidInput, NotFound
from mesh.server import MeshServer
from mesh.validation import Violations
from services.tools.builtin import BUILTIN
from services.tools.idempotency import MAX_KEY_BYTES, IdempotencyKeys
from services.tools.runner import run_tool
from services.tools.schema import arguments_of, check_arguments
from services.tools.settings import ToolsSettings
from services.tools.tool import ToolContext, ToolDefinition

SERVICE = tools_pb2.DESCRIPTOR.services_by_name["ToolsService"]
PAGE_SIZE = 50
MAX_NAME = 64
# ASCII only (\w and str.isdigit() accept "é" and "²"; these ranges do not), and bounded,
# so matching a huge string stops after a few characters.
TOOL_NAME = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_NAME}}}")
CURSOR = re.compile(r"[0-9]{1,9}")


def describe(tool: ToolDefinition, settings: ToolsSettings) -> tools_pb2.Tool:
    return tools_pb2.Tool(
        name=tool.name,
        title=tool.title,
        description=tool.description,
        input_schema=tool.input_schema,
        output_schema=tool.output_schema,
        annotations=tool.annotations,
        timeout_ms=int(tool.limits(settings)[0] * 1000),
    )


class ToolsServicer(tools_pb2_grpc.ToolsServiceServicer):
    def __init__(self, context: ToolContext, tools: tuple[ToolDefinition, ...]) -> None:
        self.context = context
        self.tools = {tool.name: tool for tool in tools}
        settings = context.settings
        self.keys = IdempotencyKeys(settings.idempotency_window_s, settings.idempotency_max_keys)

    async def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListToolsResponse:
        cursor = request.cursor or "0"  # none: the first page
        start = int(cursor) if CURSOR.fullmatch(cursor) else -1
        if not 0 <= start <= len(self.tools):
            refusal = FieldViolation("cursor", "must be a next_cursor this service returned")
            raise InvalidInput([refusal])
        names = sorted(self.tools)[start : start + PAGE_SIZE]
        end = start + len(names)
        return tools_pb2.ListToolsResponse(
            tools=[describe(self.tools[name], self.context.settings) for name in names],
            next_cursor=str(end) if end < len(self.tools) else "",
        )

    async def CallTool(
        self, request: tools_pb2.CallToolRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tools_pb2.CallToolResponse]:
        request_id.ensure(request.request_id)
        tool = self._tool(request)
        arguments = arguments_of(request.arguments)
        check_arguments(tool.input_schema, arguments).raise_if_any()
        key, entry = request.idempotency_key, None
        if key:
            canonical = json.dumps([tool.name, arguments], sort_keys=True)
            call = hashlib.sha256(canonical.encode()).hexdigest()
            while True:
                entry, runs_here = self.keys.claim(caller.current(), key, call)
                if runs_here:
                    break
                result = await asyncio.shield(entry.result)
                if result is not None:
                    yield tools_pb2.CallToolResponse(result=result)
                    return
        result = None
        try:
            async for message in run_tool(tool, arguments, self.context):
                if message.HasField("result") and not message.result.is_error:
                    result = message.result
                yield message
        finally:
            if entry is not None:
                self.keys.settle(entry, result)

    def _tool(self, request: tools_pb2.CallToolRequest) -> ToolDefinition:
        """The named tool, after the name and key are checked cheaply: either may be
        hundreds of kilobytes, and the name is quoted back in a NOT_FOUND."""
        violations = Violations()
        name, key = request.name, request.idempotency_key
        if not name:
            violations.add("name", "must name a tool from ListTools")
        elif not TOOL_NAME.fullmatch(name):
            violations.add("name", f"must be 1-{MAX_NAME} ASCII letters, digits, '_', '.' or '-'")
        violations.check(
            len(key) <= MAX_KEY_BYTES and len(key.encode()) <= MAX_KEY_BYTES,
            "idempotency_key",
            f"must be at most {MAX_KEY_BYTES} bytes (UTF-8)",
        )
        violations.raise_if_any()
        tool = self.tools.get(name)
        if tool is None:
            raise NotFound(
                f"no tool {name!r}; known: {', '.join(sorted(self.tools))}",
                resource_type="tool",
                resource_name=name,
            )
        return tool


async def setup(server: MeshServer) -> None:
    context = ToolContext(server.options_as(ToolsSettings), server.channel_to)
    servicer = ToolsServicer(context, BUILTIN)
    server.add_service(tools_pb2_grpc.add_ToolsServiceServicer_to_server, servicer, SERVICE)
