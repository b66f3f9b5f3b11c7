"""gateway: the OpenAI-compatible HTTP API (chat, completions, embeddings, images,
models) and MCP's (the tools) in front of the mesh, with API keys, per-tenant limits and
a usage ledger; it reaches the services only through mesh channels."""

from mesh.registry import ServiceSpec

SPEC = ServiceSpec(
    name="gateway",
    default_port=50110,
    description="OpenAI-compatible HTTP API: /v1/chat/completions, /v1/embeddings, ...",
    setup="services.gateway.service:setup",
    options="services.gateway.settings:GatewayOptions",
    # Its own gRPC surface is only the runtime's (health, GetInfo); the HTTP requests take
    # these slots, each a stream that mostly waits on generation.
    max_concurrency=256,
    # Readiness waits for generation and the embedder; diffusion and rerank serve when up,
    # and tools (MCP at /mcp).
    dependencies=("generation", "embedder", "diffusion", "rerank", "tools"),
    # OpenAI's own paths, as the `openai` SDK and curl scripts call them, and the rerank
    # path Cohere, Jina and vLLM share. Not all of /v1/: the edge's transcoded JSON routes
    # (/v1/generate, /v1/chat, /v1/embed, /v1/documents:rerank, ...) live there too.
    edge_http_paths=(
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/images/generations",
        "/v1/models",
        "/v1/models/",
        "/v1/rerank",
        # The ledger: a tenant reads its own usage where it sends its requests.
        "/v1/usage",
        # MCP's Streamable HTTP: the mesh's tools for MCP clients (mcp_http.py).
        "/mcp",
    ),
)
