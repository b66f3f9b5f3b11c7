"""MCP (the Model Context Protocol) at /mcp: the mesh's tools (mcp_server.py) for any MCP
client, over the official SDK's Streamable HTTP transport, behind the gateway's Front
(request id, span, key, body limits, metrics).

Each request's tool calls are made for the tenant of its key (x-aimesh-client), with
its request id; tools/list needs the key's `read` scope and tools/call its `generate`
scope, the scopes ListTools and CallTool need at the edge, refused (403) before the SDK
reads the body.

Both protocol revisions are served (the SDK tells them apart): 2026-07-28's stateless
requests, which any gateway replica answers, and 2025-11-25's sessions
(Mcp-Session-Id), held in the replica that opened them; a session belongs to the tenant
that opened it, and another tenant's key gets 404 for it. Cancelling is
notifications/cancelled in a session, closing the response in the stateless revision.
Host and Origin must be ones configured (loopback by default): a web page must not
reach the tools through a name that resolves to loopback (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import Message, Receive, Scope, Send

from aimesh.tools.v1 import tools_pb2_grpc
from mesh import caller, request_id
from services.gateway.errors import ApiError
from services.gateway.front import BODY, PRINCIPAL, missing_scope
from services.gateway.keys import Principal
from services.gateway.mcp_server import Metadata, ToolsOverMcp

PATH = "/mcp"
SESSION_HEADER = b"mcp-session-id"
# Sessions whose tenant is remembered (the SDK's own cap on open sessions is lower).
MAX_OWNED_SESSIONS = 100_000
# The scope each method needs; any other (initialize, ping, notifications) needs a key.
SCOPES = {"tools/list": "read", "tools/call": "generate"}


def request_metadata(ctx: Any) -> Metadata:
    """The tenant of the request's key, which the Front put in the HTTP request's scope,
    and its request id: the handlers run in the transport's tasks, not the request's,
    so only the request object the SDK hands them carries either."""
    principal: Principal = ctx.request.scope[PRINCIPAL]
    metadata = [(caller.METADATA_KEY, principal.tenant)]
    given = ctx.request.headers.get(request_id.METADATA_KEY, "")
    if given and request_id.is_valid(given):
        metadata.append((request_id.METADATA_KEY, given))
    return metadata


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


def _authorize(scope: Scope) -> None:
    """Refuses a method the key's scopes do not cover (403, as the Front refuses a path),
    before the SDK reads the body, from the body the Front read whole."""
    principal: Principal = scope[PRINCIPAL]
    for method in _methods(scope[BODY]):
        needed = SCOPES.get(method)
        if needed is not None and needed not in principal.scopes:
            raise missing_scope(method, needed)


class McpEndpoint:
    """The ASGI app of the /mcp route."""

    def __init__(
        self,
        tools: tools_pb2_grpc.ToolsServiceStub,
        *,
        call_timeout_s: float,
        allowed_hosts: list[str],
        allowed_origins: list[str],
    ) -> None:
        tools_server = ToolsOverMcp(
            tools, call_timeout_s=call_timeout_s, metadata=request_metadata
        ).server
        # Browsers on other sites must not reach a loopback server through DNS
        # rebinding: only the hosts and origins configured are served.
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=allowed_hosts,
            allowed_origins=allowed_origins,
        )
        self.manager = StreamableHTTPSessionManager(
            app=tools_server, stateless=False, security_settings=security
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
            _authorize(scope)
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
