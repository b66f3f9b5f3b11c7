"""Runs one tool body under its limits and turns what it yields into CallTool messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from aimesh.common.v1 import common_pb2
from aimesh.tools.v1 import tools_pb2
from mesh.timing import stage
from services.tools.tool import ToolContext, ToolDefinition, ToolError, ToolOutput


def error_result(message: str) -> tools_pb2.CallToolResult:
    return tools_pb2.CallToolResult(content=[tools_pb2.Content(text=message)], is_error=True)


def output_result(output: ToolOutput) -> tools_pb2.CallToolResult:
    images = [
        tools_pb2.Content(image=tools_pb2.ImageContent(data=data, mime_type=mime_type))
        for data, mime_type in output.images
    ]
    # protobuf takes a dict for a Struct field (None leaves it unset).
    return tools_pb2.CallToolResult(
        content=[tools_pb2.Content(text=output.text), *images],
        structured_content=output.structured,
    )


async def run_tool(
    tool: ToolDefinition, arguments: dict[str, Any], context: ToolContext
) -> AsyncIterator[tools_pb2.CallToolResponse]:
    """Progress messages, then exactly one result. Every way a tool can fail (ToolError,
    no sign of life for its idle limit, running past its time limit) is a result with
    is_error, written for the model; only cancellation and bugs propagate."""
    timeout_s, idle_timeout_s = tool.limits(context.settings)
    started = time.monotonic()
    body = tool.body(arguments, context)
    result: tools_pb2.CallToolResult | None = None
    try:
        while result is None:
            left = timeout_s - (time.monotonic() - started)
            try:
                event = await asyncio.wait_for(anext(body), timeout=min(idle_timeout_s, left))
            except TimeoutError:
                ran = time.monotonic() - started
                why = (
                    f"ran past its {timeout_s:g} s limit"
                    if ran >= timeout_s - 0.01
                    else f"sent no progress for {idle_timeout_s:g} s"
                )
                result = error_result(f"{tool.name} {why} and was stopped")
            except ToolError as error:
                result = error_result(str(error))
            else:
                if isinstance(event, ToolOutput):
                    result = output_result(event)
                else:
                    yield tools_pb2.CallToolResponse(progress=event)
    finally:
        await body.aclose()
    elapsed = time.monotonic() - started
    result.timing.stages.append(stage(tool.name, elapsed, common_pb2.STAGE_KIND_COMPUTE, "tools"))
    result.timing.total_ns = int(elapsed * 1e9)
    yield tools_pb2.CallToolResponse(result=result)
