"""MCP servers the agent mounts: their tools join a run's catalogue beside the tools
service's, each call with the mesh's contract around it.

A mount keeps one connection to its server open in a task of its own (the official SDK's
Client: Streamable HTTP with a bearer key, or a stdio child it starts), reconnecting
with backoff when the connection breaks or cannot be made; a server that is down costs
each run a note, never the run. Its tools are listed once per connection, and again
after the server says they changed (notifications/tools/list_changed, or a
subscriptions/listen event at 2026-07-28), as
`<server>__<tool>`: OpenAI-style function names allow no `.` ([a-zA-Z0-9_-]{1,64}),
which is why the separator is Claude Code's and not a dot. A tool is skipped, with a
note, when that name does not fit or its input schema is not a valid JSON Schema; when
the server's settings name `allowed_tools`, only those are offered.

Around each call: the run's budget, cut to the server's call_timeout_s; a circuit
breaker per server (the mesh's, fed by transport failures and timeouts, not by a
tool's own failure or the server refusing bad arguments); at most max_concurrency calls
in flight; a result larger than max_result_bytes refused. A tool's own failure
(isError) and a refused call come back as error observations for the model to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import jsonschema
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from mcp import Client, StdioServerParameters, types
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from prometheus_client import Counter, Gauge, Histogram

from aimesh.mesh.v1 import info_pb2
from mesh.breaker import CircuitBreaker, Outcome
from mesh.config import BreakerSettings
from mesh.errors import clipped
from services.agent import loop
from services.agent.planner import Observation, Tool, ToolStep
from services.agent.settings import McpServerSettings

SEPARATOR = "__"
# The function names the generation router (and OpenAI) accept.
MODEL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A tool's schema, as the router takes it.
MAX_SCHEMA_BYTES = 64 * 1024
# tools/list pages read per connection, and tools kept from one server.
MAX_PAGES = 20
MAX_TOOLS = 256
# Reconnection backoff, doubling from the first to the last.
RETRY_FIRST_S, RETRY_LAST_S = 0.5, 30.0
# A note quotes at most this many bytes of a server's own words.
MAX_QUOTED = 200
# JSON-RPC errors that say the call was wrong, not the server: the model reads them.
REFUSALS = frozenset(
    {types.INVALID_PARAMS, types.INVALID_REQUEST, types.METHOD_NOT_FOUND, types.PARSE_ERROR}
)

CALLS = Counter(
    "aimesh_agent_mcp_calls_total",
    "Calls of mounted MCP servers' tools, by server, tool and outcome (ok, tool_error, "
    "refused, too_large, timeout, unavailable).",
    ["server", "tool", "outcome"],
)
UP = Gauge(
    "aimesh_agent_mcp_server_up",
    "1 while the agent holds a connection to the mounted MCP server, else 0.",
    ["server"],
)
LATENCY = Histogram(
    "aimesh_agent_mcp_call_seconds",
    "Duration of calls of mounted MCP servers' tools, by server.",
    ["server"],
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listed:
    """A server's tools as the run's catalogue holds them, by namespaced name, and why
    any it listed were left out."""

    tools: dict[str, Tool]
    notes: tuple[str, ...]
    # The server's own name of each tool, by namespaced name.
    names: dict[str, str]


class Mount:
    """One MCP server: its connection, its tools, its breaker and its call slots. Its
    state is reported as `aimesh_agent_mcp_server_up{server}`, in `info` (an entry for
    the process's GetInfo) and, given `health`, as the health service name
    `<health_prefix>.mcp-<name>` (SERVING while connected): a detail for operators, not
    readiness, as the agent serves without it."""

    def __init__(
        self,
        settings: McpServerSettings,
        breaker: BreakerSettings,
        health: HealthServicer | None = None,
        health_prefix: str = "agent",
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self._health = health
        self.problem = "not connected yet"
        self.info = info_pb2.ExternalServer(
            name=settings.name, protocol="mcp", address=_shown(settings), problem=self.problem
        )
        self.health_name = f"{health_prefix}.mcp-{settings.name}"
        self.breaker = CircuitBreaker(f"mcp:{settings.name}", breaker)
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self._client: Client | None = None
        self._listed: Listed | None = None
        # Set once the first connection attempt has ended, however: a listing waits for
        # the first, never for a reconnection (a server down costs a note at once).
        self._tried = asyncio.Event()
        self._broken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._keep_connected(), name=f"mcp-{self.name}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _keep_connected(self) -> None:
        """Connects, holds the connection until a call finds it broken, and connects
        again, waiting longer after each failure in a row."""
        delay_s = RETRY_FIRST_S
        while True:
            try:
                async with self._connection() as client:
                    self._client, self.problem, delay_s = client, "", RETRY_FIRST_S
                    self._tried.set()
                    await self._report(up=True)
                    log.info("mcp server connected", extra={"server": self.name})
                    watching = asyncio.create_task(self._watch_for_changes(client))
                    try:
                        await self._broken.wait()
                    finally:
                        watching.cancel()
                        await asyncio.gather(watching, return_exceptions=True)
                    self.problem = "the connection broke"
            except Exception as error:  # the SDK's transports raise many kinds (groups too)
                self.problem = clipped(f"{type(error).__name__}: {error}", MAX_QUOTED)
                log.warning("mcp server unreachable: %s", self.problem, extra={"server": self.name})
            finally:
                self._client, self._listed = None, None
                self._broken.clear()
            await self._report(up=False)
            self._tried.set()
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, RETRY_LAST_S)

    async def _watch_for_changes(self, client: Client) -> None:
        """At 2026-07-28, a subscription to the server's tools-changed events; earlier
        revisions send notifications/tools/list_changed unasked (_on_message)."""
        with contextlib.suppress(ListenNotSupportedError, SubscriptionLost, MCPError):
            async with client.listen(tools_list_changed=True) as changes:
                async for _ in changes:
                    self._listed = None

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._listed = None

    async def _report(self, up: bool) -> None:
        UP.labels(self.name).set(1 if up else 0)
        self.info.connected, self.info.problem = up, self.problem
        if self._health is not None:
            status = health_pb2.HealthCheckResponse
            await self._health.set(self.health_name, status.SERVING if up else status.NOT_SERVING)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Client]:
        settings = self.settings
        async with AsyncExitStack() as stack:
            if settings.url:
                headers = {}
                if settings.key_file is not None:
                    key = settings.key_file.read_text().strip()
                    headers["authorization"] = f"Bearer {key}"
                http = await stack.enter_async_context(create_mcp_http_client(headers=headers))
                server: Any = streamable_http_client(settings.url, http_client=http)
            else:
                # The SDK's safe subset of the agent's environment (PATH, HOME, ...), not
                # its secrets, and what the settings add.
                server = StdioServerParameters(
                    command=settings.command[0],
                    args=settings.command[1:],
                    env={**get_default_environment(), **settings.env},
                )
            client = Client(server, mode=settings.protocol, message_handler=self._on_message)
            yield await stack.enter_async_context(client)

    async def tools(self, timeout_s: float) -> Listed:
        """The server's tools, listed once per connection; waits up to `timeout_s` for the
        first connection. Raises loop.Unavailable when there is none."""
        if self._listed is not None:
            return self._listed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._tried.wait()
        client = self._client
        if client is None:
            raise loop.Unavailable("UNAVAILABLE", self.problem)
        try:
            async with asyncio.timeout(timeout_s):
                listed = await self._list(client)
        except TimeoutError:
            raise loop.Unavailable("DEADLINE_EXCEEDED", "tools/list took too long") from None
        except MCPError as error:
            raise loop.Unavailable("REFUSED", clipped(error.message, MAX_QUOTED)) from None
        except Exception as error:
            self._broken.set()
            raise loop.Unavailable("UNAVAILABLE", clipped(str(error), MAX_QUOTED)) from None
        self._listed = listed
        return listed

    async def _list(self, client: Client) -> Listed:
        found: list[types.Tool] = []
        cursor = None
        for _ in range(MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            found.extend(page.tools)
            cursor = page.next_cursor
            if not cursor or len(found) >= MAX_TOOLS:
                break
        allowed = set(self.settings.allowed_tools)
        tools: dict[str, Tool] = {}
        names: dict[str, str] = {}
        notes: list[str] = []
        for tool in found[:MAX_TOOLS]:
            if allowed and tool.name not in allowed:
                continue
            problem = _unusable(self.name, tool)
            if problem:
                skipped = clipped(tool.name, MAX_QUOTED)
                notes.append(f"MCP server {self.name}: skipped tool {skipped}: {problem}")
                continue
            name = f"{self.name}{SEPARATOR}{tool.name}"
            tools[name] = Tool(name, tool.description or tool.title or "", dict(tool.input_schema))
            names[name] = tool.name
        missing = sorted(allowed - {tool.name for tool in found})
        if missing:
            notes.append(f"MCP server {self.name} lists no tool {', '.join(missing)}")
        return Listed(tools, tuple(notes), names)

    async def call(self, step: ToolStep, tool: str, timeout_s: float) -> Observation:
        """`step` as a call of the server's `tool`. Raises loop.Unavailable when the call
        itself failed (no connection, breaker open, timeout, transport broken)."""
        refused = self.breaker.before_call(tool)
        if refused is not None:
            CALLS.labels(self.name, tool, "unavailable").inc()
            raise loop.Unavailable("UNAVAILABLE", f"MCP server {self.name}: {refused.details}")
        client = self._client
        if client is None:
            CALLS.labels(self.name, tool, "unavailable").inc()
            raise loop.Unavailable("UNAVAILABLE", f"MCP server {self.name}: {self.problem}")
        started = time.monotonic()
        limit_s = min(timeout_s, self.settings.call_timeout_s)
        try:
            async with asyncio.timeout(limit_s), self._slots:
                result = await client.call_tool(tool, step.arguments)
        except TimeoutError:
            self._record(tool, "timeout", Outcome.FAILURE, started)
            raise loop.Unavailable(
                "DEADLINE_EXCEEDED", f"MCP server {self.name}: no result in {limit_s:.1f} s"
            ) from None
        except MCPError as error:
            if error.code in REFUSALS:  # the call's own fault: its arguments, say
                self._record(tool, "refused", Outcome.IGNORED, started)
                why = clipped(error.message, MAX_QUOTED)
                return Observation(step, True, f"the server refused the call: {why}")
            if error.code == types.CONNECTION_CLOSED:
                self._broken.set()
            self._record(tool, "unavailable", Outcome.FAILURE, started)
            why = clipped(error.message, MAX_QUOTED)
            raise loop.Unavailable("UNAVAILABLE", f"MCP server {self.name}: {why}") from None
        except Exception as error:
            self._broken.set()
            self._record(tool, "unavailable", Outcome.FAILURE, started)
            why = clipped(str(error) or type(error).__name__, MAX_QUOTED)
            raise loop.Unavailable("UNAVAILABLE", f"MCP server {self.name}: {why}") from None
        text = "\n".join(block.text for block in result.content if block.type == "text")
        structured = result.structured_content or {}
        size = len(text.encode()) + len(json.dumps(structured).encode())
        if size > self.settings.max_result_bytes:
            self._record(tool, "too_large", Outcome.SUCCESS, started)
            why = (
                f"its result of {size} bytes is over the limit of {self.settings.max_result_bytes}"
            )
            return Observation(step, True, f"refused: {why}")
        outcome = "tool_error" if result.is_error else "ok"
        self._record(tool, outcome, Outcome.SUCCESS, started)
        return Observation(step, bool(result.is_error), text, dict(structured))

    def _record(self, tool: str, outcome: str, breaker: Outcome, started: float) -> None:
        elapsed = time.monotonic() - started
        self.breaker.record(breaker, elapsed)
        CALLS.labels(self.name, tool, outcome).inc()
        LATENCY.labels(self.name).observe(elapsed)


def _shown(settings: McpServerSettings) -> str:
    """Where the server is, as GetInfo may show it to anyone: a URL without credentials
    or query, a command's program without its arguments (either may hold a secret)."""
    if settings.command:
        return settings.command[0]
    url = urlsplit(settings.url)
    host = url.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if url.port is not None:
        netloc += f":{url.port}"
    return urlunsplit((url.scheme, netloc, url.path, "", ""))


def _unusable(server: str, tool: types.Tool) -> str:
    """Why the agent cannot offer `tool`; "" when it can."""
    name = f"{server}{SEPARATOR}{tool.name}"
    if not MODEL_NAME.fullmatch(name):
        return f"{name!r} is no function name (1 to 64 of a-z, A-Z, 0-9, _ and -)"
    schema = tool.input_schema
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        return f"its input schema is over {MAX_SCHEMA_BYTES} bytes"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        return f"its input schema is invalid: {clipped(error.message, MAX_QUOTED)}"
    return ""


class MountedTools:
    """loop.Tools over the tools service and the mounted servers together: a call of
    `<server>__<tool>` goes to that server, any other to the tools service."""

    def __init__(self, mesh: loop.Tools, mounts: Sequence[Mount]) -> None:
        self.mesh = mesh
        self.mounts = {mount.name: mount for mount in mounts}
        self._names: dict[str, tuple[Mount, str]] = {}

    async def list(self, timeout_s: float) -> loop.Catalogue:
        if not self.mounts:
            return await self.mesh.list(timeout_s)
        mounted = list(self.mounts.values())
        mesh, *servers = await asyncio.gather(
            self.mesh.list(timeout_s),
            *(mount.tools(timeout_s) for mount in mounted),
            return_exceptions=True,
        )
        tools: dict[str, Tool] = {}
        notes: list[str] = []
        for mount, listed in zip(mounted, servers, strict=True):
            if isinstance(listed, loop.Unavailable):
                notes.append(f"MCP server {mount.name} unavailable ({listed}); its tools unused")
            elif isinstance(listed, BaseException):
                raise listed
            else:
                tools.update(listed.tools)
                notes.extend(listed.notes)
                for name, own in listed.names.items():
                    self._names[name] = (mount, own)
        if isinstance(mesh, BaseException):
            if not isinstance(mesh, loop.Unavailable) or not tools:
                raise mesh
            notes.append(f"the tools service was unavailable ({mesh}); mounted tools only")
        else:
            tools = {**mesh.tools, **tools}
            notes = [*mesh.notes, *notes]
        return loop.Catalogue(tools, tuple(notes))

    async def call(self, step: ToolStep, timeout_s: float) -> Observation | None:
        routed = self._names.get(step.name)
        if routed is None:
            return await self.mesh.call(step, timeout_s)
        mount, tool = routed
        return await mount.call(step, tool, timeout_s)
