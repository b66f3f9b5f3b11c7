"""MCP at the gateway's /mcp, driven by the official MCP SDK's client at both protocol
revisions: the tools service's tools listed and called for the key's tenant, progress,
a tool's own failure as isError, the caller's mistakes as INVALID_PARAMS naming the
field, cancellation reaching the service the tool waits on, and keys, scopes and Host
headers refused over plain HTTP; and `aimesh mcp`, the same server over stdio, launched
by the SDK's client as a desktop client launches it. Every hop is real: the SDK's
client, the gateway, the tools service, and a scripted retrieval server where a tool
needs one."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client, StdioServerParameters, types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.config import MeshSettings, ServiceSettings
from mesh.server import MeshServer
from services.tools.builtin import BUILTIN
from tests.conftest import free_port
from tests.harness import InProcess
from tests.services.gateway.conftest import Gateway, running_gateway

pytestmark = pytest.mark.service

KEYS = {
    "sk-tools": ("acme", ["read", "generate"]),
    "sk-reader": ("acme", ["read"]),
    "sk-embed-only": ("embedco", ["embed"]),
    "sk-other": ("otherco", ["read", "generate"]),
}
# The handshake revision (2025-11-25) and the stateless one (2026-07-28).
MODES = ["legacy", "2026-07-28"]


class StalledRetrieval(retrieval_pb2_grpc.RetrievalServiceServicer):
    """A retrieval whose Search waits until its caller gives up, and says so."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def Search(self, request, context):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return retrieval_pb2.SearchResponse()


@asynccontextmanager
async def tools_service(
    retrieval: str | None = None, **tools_settings: object
) -> AsyncIterator[str]:
    """A tools service whose retrieval is `retrieval` (a closed port unless given), with
    [services.tools] settings; its target."""
    async with InProcess() as services:
        if retrieval is None:
            retrieval = f"127.0.0.1:{free_port()}"
        dependencies = {"retrieval": retrieval, "diffusion": f"127.0.0.1:{free_port()}"}
        tools = ServiceSettings(dependencies=dependencies, **tools_settings)
        settings = MeshSettings(services={"tools": tools})
        yield (await services.start("tools", settings)).target


@asynccontextmanager
async def mcp_gateway(
    tmp_path, retrieval: str | None = None, **tools_settings: object
) -> AsyncIterator[Gateway]:
    """The gateway in front of tools_service(retrieval, **tools_settings)."""
    async with (
        tools_service(retrieval, **tools_settings) as tools,
        running_gateway(tmp_path, keys=KEYS, dependencies={"tools": tools}) as gateway,
    ):
        yield gateway


@asynccontextmanager
async def mcp_client(gateway: Gateway, mode: str, key: str = "sk-tools") -> AsyncIterator[Client]:
    """The SDK's client on /mcp with `key`, speaking the revision `mode` names."""
    http = create_mcp_http_client(headers={"authorization": f"Bearer {key}"})
    async with http:
        transport = streamable_http_client(f"{gateway.url}/mcp", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


@pytest.mark.parametrize("mode", MODES)
async def test_an_mcp_client_lists_and_calls_the_mesh_tools(tmp_path, mode):
    async with mcp_gateway(tmp_path) as gateway, mcp_client(gateway, mode) as client:
        listed = await client.list_tools()
        assert sorted(t.name for t in listed.tools) == sorted(t.name for t in BUILTIN)
        calculator = next(t for t in listed.tools if t.name == "calculator")
        assert calculator.input_schema["required"] == ["expression"]
        assert calculator.output_schema["properties"]["value"] == {"type": "number"}
        hints = calculator.annotations
        assert (hints.read_only_hint, hints.destructive_hint, hints.open_world_hint) == (
            True,
            False,
            False,
        )

        result = await client.call_tool("calculator", {"expression": "17 * 23"})
        assert not result.is_error
        assert result.structured_content["value"] == 391
        assert "391" in result.content[0].text

        # The tool's own failure is a result the model reads, not a protocol error.
        failed = await client.call_tool("calculator", {"expression": "1 / 0"})
        assert failed.is_error and failed.content[0].type == "text"


@pytest.mark.parametrize("mode", MODES)
async def test_progress_reaches_the_client_and_a_dead_backend_is_the_tools_error(tmp_path, mode):
    """knowledge_search reports progress, then finds retrieval down: that is the tool's
    failure (isError, saying which service), not the protocol's."""
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message))

    async with mcp_gateway(tmp_path) as gateway, mcp_client(gateway, mode) as client:
        result = await client.call_tool(
            "knowledge_search", {"query": "copy a list"}, progress_callback=progress
        )
    assert result.is_error and "UNAVAILABLE" in result.content[0].text
    assert seen == [(0, 1, "searching the knowledge base")]


@pytest.mark.parametrize("mode", MODES)
async def test_the_callers_mistakes_are_invalid_params_naming_the_field(tmp_path, mode):
    async with mcp_gateway(tmp_path) as gateway, mcp_client(gateway, mode) as client:
        with pytest.raises(MCPError) as unknown:
            await client.call_tool("no_such_tool", {})
        assert unknown.value.code == types.INVALID_PARAMS
        assert "no tool 'no_such_tool'" in unknown.value.message

        with pytest.raises(MCPError) as refused:
            await client.call_tool("calculator", {"expression": 42})
        assert refused.value.code == types.INVALID_PARAMS
        assert any(v["field"].startswith("arguments") for v in refused.value.data)

        with pytest.raises(MCPError) as cursor:
            await client.list_tools(cursor="not-a-cursor")
        assert cursor.value.code == types.INVALID_PARAMS
        # The endpoint serves on after each refusal.
        assert (await client.call_tool("calculator", {"expression": "2+2"})).structured_content


@pytest.mark.parametrize("mode", MODES)
async def test_a_client_that_cancels_a_call_cancels_the_tool_and_its_backend(
    tmp_path, start_fake_retrieval, mode
):
    stalled = StalledRetrieval()
    retrieval = await start_fake_retrieval(stalled)
    # The tool's own limits far off: only the client's cancel can stop it in the wait.
    limits = {"knowledge_search": 600}
    async with (
        mcp_gateway(tmp_path, retrieval, timeout_s=limits, idle_timeout_s=limits) as gateway,
        mcp_client(gateway, mode) as client,
    ):
        call = asyncio.create_task(client.call_tool("knowledge_search", {"query": "anything"}))
        await asyncio.wait_for(stalled.started.wait(), timeout=60)
        call.cancel()
        await asyncio.wait_for(stalled.cancelled.wait(), timeout=60)
        with pytest.raises(asyncio.CancelledError):
            await call
        # The same client goes on.
        assert (await client.call_tool("calculator", {"expression": "2+2"})).structured_content


@pytest.fixture
async def start_fake_retrieval():
    async with InProcess() as services:

        async def start(servicer: retrieval_pb2_grpc.RetrievalServiceServicer) -> str:
            async def serve(server: MeshServer) -> None:
                retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(
                    servicer, server.grpc_server
                )

            return (await services.start("echo", setup=serve)).target

        yield start


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "curl", "version": "1"},
    },
}
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


def _call(name: str) -> dict:
    arguments = {"expression": "1+1"}
    return {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }


async def test_keys_scopes_and_foreign_hosts_are_refused_before_any_tool_runs(tmp_path):
    async with mcp_gateway(tmp_path) as gateway:
        url = f"{gateway.url}/mcp"
        async with httpx.AsyncClient(timeout=30) as http:
            anonymous = await http.post(url, json=INITIALIZE, headers=HEADERS)
            assert anonymous.status_code == 401

            def keyed(key: str) -> dict[str, str]:
                return {**HEADERS, "authorization": f"Bearer {key}"}

            # A read key lists the tools but may not call one.
            reader = await http.post(url, json=INITIALIZE, headers=keyed("sk-reader"))
            assert reader.status_code == 200
            called = await http.post(url, json=_call("calculator"), headers=keyed("sk-reader"))
            assert called.status_code == 403
            assert "'generate' scope" in called.json()["error"]["message"]
            embedder = await http.post(
                url, json=_call("calculator"), headers=keyed("sk-embed-only")
            )
            assert embedder.status_code == 403

            # A session is its tenant's: another tenant's key cannot use its id.
            session = {"mcp-session-id": reader.headers["mcp-session-id"]}
            listing = {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
            mine = await http.post(url, json=listing, headers={**keyed("sk-tools"), **session})
            assert mine.status_code == 200 and "calculator" in mine.text
            theirs = await http.post(url, json=listing, headers={**keyed("sk-other"), **session})
            assert theirs.status_code == 404 and "calculator" not in theirs.text

            # A page elsewhere, reaching loopback through a name of its own (DNS rebinding).
            foreign = await http.post(
                url, json=INITIALIZE, headers={**keyed("sk-tools"), "host": "evil.example:80"}
            )
            assert foreign.status_code in (400, 403, 421)
            origin = await http.post(
                url,
                json=INITIALIZE,
                headers={**keyed("sk-tools"), "origin": "http://evil.example"},
            )
            assert origin.status_code == 403

            # A body that is not JSON is the SDK's parse error, not a crash.
            garbage = await http.post(url, content=b"{not json", headers=keyed("sk-tools"))
            assert garbage.status_code == 400
            assert json.loads(garbage.text)["error"]["code"] == types.PARSE_ERROR
            assert (await http.get(f"{gateway.url}/health/live")).status_code == 200


@pytest.mark.parametrize("mode", MODES)
async def test_aimesh_mcp_serves_the_same_tools_over_stdio(mode):
    """`aimesh mcp` as a desktop client starts it: a child process on stdin and stdout,
    its key in the environment; it ends with the client."""
    async with tools_service() as target:
        launch = StdioServerParameters(
            command=sys.executable,
            args=["-m", "mesh.cli", "mcp", "--target", target],
            env={**os.environ, "AIMESH_API_KEY": "sk-unused-without-an-edge"},
        )
        async with Client(launch, mode=mode) as client:
            listed = await client.list_tools()
            assert sorted(t.name for t in listed.tools) == sorted(t.name for t in BUILTIN)
            result = await client.call_tool("calculator", {"expression": "6 * 7"})
            assert result.structured_content["value"] == 42
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("no_such_tool", {})
            assert unknown.value.code == types.INVALID_PARAMS


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | st.sampled_from(["é" * 70_000, "\ud800", "calculator", "1+1", ""])
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)
METHODS = st.sampled_from(["tools/call", "tools/list", "ping", "initialize", "nope", ""])
PARAMS = JSON_VALUES | st.fixed_dictionaries(
    {"name": st.sampled_from(["calculator", "knowledge_search", "", "x" * 300]) | st.text()},
    optional={"arguments": JSON_VALUES, "cursor": JSON_VALUES, "_meta": JSON_VALUES},
)
MESSAGES = st.fixed_dictionaries(
    {"jsonrpc": st.sampled_from(["2.0", "1.0"]), "method": METHODS},
    optional={"id": st.integers() | st.text(max_size=8) | st.none(), "params": PARAMS},
)


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


ENVELOPE = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}


def _modern(headers: dict[str, str], message: dict) -> dict[str, str]:
    """The 2026-07-28 headers: the revision, and the method and tool name the body holds
    (which the revision requires to match it); the body's params get the revision's
    `_meta` envelope where they are an object, so that the message reaches a handler."""
    if isinstance(message.get("params"), dict):
        message["params"]["_meta"] = ENVELOPE
    modern = {**headers, "mcp-protocol-version": "2026-07-28", "mcp-method": message["method"]}
    params = message.get("params")
    name = params.get("name") if isinstance(params, dict) else None
    if isinstance(name, str) and name.isascii() and name.isprintable():
        modern["mcp-name"] = name
    return modern


async def test_any_message_is_answered_without_a_server_error(tmp_path):
    """Hypothesis' JSON-RPC messages of any shape (huge, non-ASCII, lone surrogates,
    integers past 64 bits, nesting past what protobuf's Struct takes) at both revisions:
    never a 5xx, and the endpoint serves on."""
    headers = {**HEADERS, "authorization": "Bearer sk-tools"}
    async with mcp_gateway(tmp_path) as gateway, httpx.AsyncClient(timeout=60) as http:
        url = f"{gateway.url}/mcp"
        deep = {**_call("calculator"), "params": {"name": "calculator", "arguments": _nested(300)}}
        for message in (INITIALIZE, deep):
            for sent in (headers, _modern(headers, message)):
                reply = await http.post(url, json=message, headers=sent)
                assert reply.status_code < 500, reply.text
        # A 2025-11-25 session for the messages sent at that revision.
        opened = await http.post(url, json=INITIALIZE, headers=headers)
        legacy = {
            **headers,
            "mcp-session-id": opened.headers["mcp-session-id"],
            "mcp-protocol-version": "2025-11-25",
        }

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(message=MESSAGES, modern=st.booleans())
        def fuzzed(message: dict, modern: bool) -> None:
            body = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
            sent = _modern(headers, message) if modern else legacy
            reply = asyncio.run_coroutine_threadsafe(
                http.post(url, content=body, headers=sent), loop
            ).result(timeout=60)
            assert reply.status_code < 500, (message, reply.text)

        loop = asyncio.get_running_loop()
        await asyncio.to_thread(fuzzed)
        async with mcp_client(gateway, "2026-07-28") as client:
            result = await client.call_tool("calculator", {"expression": "2+2"})
        assert result.structured_content["value"] == 4
