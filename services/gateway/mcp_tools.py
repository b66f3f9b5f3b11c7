"""MCP (the Model Context Protocol) at /mcp: the mesh's tools for any MCP client, over
the official SDK's Streamable HTTP transport.

One implementation underneath, two transports: each MCP request becomes a ToolsService
call over the mesh, so validation, time limits, idempotency and tenancy are the tools
service's own, exactly as for a gRPC caller. The call is made for the tenant of the
request's key; tools/list needs the key's `read` scope and tools/call its `generate`
scope, the scopes ListTools and CallTool need at the edge.

Both protocol revisions are served (the SDK tells them apart): 2026-07-28's stateless
requests, which any gateway replica answers, and 2025-11-25's sessions (Mcp-Session-Id),
which the edge keeps on one replica; a session belongs to the tenant that opened it, and
another tenant's key gets 404 for it. A call's Progress becomes notifications/progress
on the POST's SSE response when the client asked for it (a progressToken); a client
that cancels (notifications/cancelled, or closing the response in the stateless
revision) cancels the gRPC call, and so the tool.
A tool's own failure is a result with isError, for the model to read; an unknown tool
or arguments its schema refuses are INVALID_PARAMS, naming the field; the tools service
out of reach is INTERNAL_ERROR.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import json_format
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.types import Message, Receive, Scope, Send

from aimesh.tools.v1 import tools_pb2, tools_pb2_grpc
from mesh import caller, request_id
from mesh.errors import field_violations
from services.gateway.errors import ApiError
from services.gateway.front import PRINCIPAL
from services.gateway.keys import Principal

PATH = "/mcp"
SESSION_HEADER = b"mcp-session-id"
# Sessions whose tenant is remembered (the SDK's own cap on open sessions is lower).
MAX_OWNED_SESSIONS = 100_000
# The scope each method needs; any other (initialize, ping, notifications) needs a key.
SCOPES = {"tools/list": "read", "tools/call": "generate"}
# Codes the tools service answers for the caller's mistakes: the MCP client's to fix.
_CALLERS_MISTAKES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


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


def _principal(ctx: Any) -> Principal:
    """The key's principal, which the Front put in the HTTP request's scope: the
    handlers run in the transport's tasks, not the request's, so only the request
    object the SDK hands them carries it."""
    return ctx.request.scope[PRINCIPAL]


def _methods(body: bytes) -> Iterable[str]:
    """The JSON-RPC methods a POST body asks for; none when it does not parse (the
    SDK answers that with its own parse error)."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return ()
    messages = message if isinstance(message, list) else [message]
    methods = (m.get("method") for m in messages if isinstance(m, dict))
    return [method for method in methods if isinstance(method, str)]


class McpTools:
    """The MCP server of the mesh's tools, an ASGI app for the /mcp route."""

    def __init__(
        self,
        tools: tools_pb2_grpc.ToolsServiceStub,
        *,
        call_timeout_s: float,
        allowed_hosts: list[str],
        allowed_origins: list[str],
    ) -> None:
        self._tools = tools
        self._call_timeout_s = call_timeout_s
        self.server: Server[Any] = Server(
            "aimesh-tools",
            version="0.1.0",
            instructions="The aimesh mesh's tools: knowledge search, images, arithmetic.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # Browsers on other sites must not reach a loopback server through DNS
        # rebinding: only the hosts and origins configured are served.
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=allowed_hosts,
            allowed_origins=allowed_origins,
        )
        self.manager = StreamableHTTPSessionManager(
            app=self.server, stateless=False, security_settings=security
        )
        self._running = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._owners: OrderedDict[str, str] = OrderedDict()  # session id -> tenant

    def start(self) -> asyncio.Task[None]:
        """Holds the transport's task group, in which every request's handler runs, in a
        task for the life of the process (uvicorn's lifespan is off: the gateway owns
        it); the caller should watch the task."""
        self._task = asyncio.create_task(self._serve(), name="mcp")
        return self._task

    async def stop(self) -> None:
        """After the HTTP server drained: ends the task group, cancelling what is left."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _serve(self) -> None:
        async with self.manager.run():
            self._running.set()
            await asyncio.Event().wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = scope[PRINCIPAL].tenant
        session = dict(scope["headers"]).get(SESSION_HEADER, b"").decode("latin-1")
        if session and self._owners.get(session, tenant) != tenant:
            raise ApiError(
                404, "no such MCP session for this key", type="not_found_error", code="no_session"
            )
        if scope["method"] == "POST":
            receive = await self._authorized(scope, receive)
        if scope["method"] == "DELETE":
            self._owners.pop(session, None)
        await self._running.wait()

        async def owned(message: Message) -> None:
            if message["type"] == "http.response.start":
                opened = dict(message.get("headers", [])).get(SESSION_HEADER)
                if opened:
                    self._remember(opened.decode("latin-1"), tenant)
            await send(message)

        await self.manager.handle_request(scope, receive, owned)

    def _remember(self, session: str, tenant: str) -> None:
        self._owners[session] = tenant
        self._owners.move_to_end(session)
        while len(self._owners) > MAX_OWNED_SESSIONS:
            self._owners.popitem(last=False)

    async def _authorized(self, scope: Scope, receive: Receive) -> Receive:
        """Refuses a method the key's scopes do not cover (403, as the Front refuses a
        path), before the SDK parses the body; the body, which the Front read whole,
        is replayed to it."""
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        principal: Principal = scope[PRINCIPAL]
        for method in _methods(body):
            needed = SCOPES.get(method)
            if needed is not None and needed not in principal.scopes:
                raise ApiError(
                    403,
                    f"this key's tenant may not call {method} (it needs the {needed!r} scope)",
                    type="permission_error",
                    code="missing_scope",
                )
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    def _metadata(self, ctx: Any) -> tuple[tuple[str, str], ...]:
        metadata = ((caller.METADATA_KEY, _principal(ctx).tenant),)
        given = ctx.request.headers.get(request_id.METADATA_KEY, "")
        if given and request_id.is_valid(given):
            metadata += ((request_id.METADATA_KEY, given),)
        return metadata

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
