"""MCP through the edge: the official SDK's client reaches the mesh's tools at Envoy's
/mcp with a key, at both protocol revisions, and a key without the scope is refused."""

from __future__ import annotations

import httpx
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

pytestmark = pytest.mark.system


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_an_mcp_client_calls_the_mesh_tools_through_envoy_with_a_key(edge, mode):
    http = create_mcp_http_client(headers={"authorization": "Bearer sk-tools"})
    async with (
        http,
        Client(streamable_http_client(f"{edge.url}/mcp", http_client=http), mode=mode) as client,
    ):
        listed = await client.list_tools()
        assert "calculator" in {tool.name for tool in listed.tools}
        result = await client.call_tool("calculator", {"expression": "(2 + 3) * 7"})
        assert not result.is_error and result.structured_content["value"] == 35


async def test_a_key_without_the_scope_cannot_call_a_tool_through_envoy(edge):
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "calculator", "arguments": {"expression": "1+1"}},
    }
    headers = {"accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        anonymous = await client.post("/mcp", json=call, headers=headers)
        assert anonymous.status_code == 401
        refused = await client.post(
            "/mcp", json=call, headers={**headers, "authorization": "Bearer sk-embed-only"}
        )
        assert refused.status_code == 403
