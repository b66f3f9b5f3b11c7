"""The gateway's own settings ([services.gateway] in the mesh config)."""

from __future__ import annotations

from pydantic import Field

from mesh.config import HttpServiceOptions


class GatewayOptions(HttpServiceOptions):
    """[services.gateway]. The HTTP API listens on the service's `host` (loopback unless
    set), beside the gRPC port that answers health and GetInfo. Its `api_keys_file` holds
    hashed keys (services/gateway/keys.py); without one every caller is the tenant
    'anonymous'."""

    # A client that stops reading would otherwise hold its decode slot and KV lease while
    # the socket buffers fill; past this, the stream is cancelled like a disconnect.
    send_timeout_s: float = Field(default=30.0, gt=0)
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="how often the dependencies' readiness and models are read"
    )
    # The gateway's own bounds on a request body (Envoy has its own in front; the gateway
    # may be reached without it): services/gateway/request_body.py.
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="largest request body taken (413 past it): 4 times the 1 MiB of text the "
        "generation router takes in one prompt, room for JSON's escapes",
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="time a request's whole body may take to arrive (408 past it): a full-size "
        "body needs about 1.1 Mbit/s",
    )
    # MCP at /mcp answers only these Host and Origin headers (DNS-rebinding protection:
    # a web page must not reach the tools through a name that resolves to loopback).
    # Behind a public name, add it ("tools.example.com:*", "https://tools.example.com").
    mcp_allowed_hosts: list[str] = Field(
        default=["127.0.0.1:*", "localhost:*", "[::1]:*"],
        description="Host headers /mcp answers (a port or :* after each)",
    )
    mcp_allowed_origins: list[str] = Field(
        default=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        description="Origin headers /mcp answers (requests without one are served)",
    )
