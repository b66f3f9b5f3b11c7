"""tools: MCP's tool model over gRPC; built-in tools wrap retrieval and diffusion."""

from mesh.authz import EDGE, OPERATOR
from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="tools",
    default_port=50090,
    description="Tools: JSON-Schema'd tools with progress and structured results",
    setup="services.tools.servicer:setup",
    options="services.tools.settings:ToolsSettings",
    # A tool call mostly waits on the service it wraps; the agent runs several at once.
    max_concurrency=64,
    exempt_methods=("/aimesh.tools.v1.ToolsService/ListTools",),
    edge_services=("aimesh.tools.v1.ToolsService",),
    dependencies=("retrieval", "diffusion"),
    # The gateway serves the tools to MCP clients (services/gateway/mcp_server.py).
    callers=(("aimesh.tools.v1.ToolsService", (EDGE, OPERATOR, "agent", "gateway")),),
    scopes=(
        ("aimesh.tools.v1.ToolsService", "generate"),
        ("/aimesh.tools.v1.ToolsService/ListTools", "read"),
    ),
)
