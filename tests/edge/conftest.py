"""The LLM stack, the embedder, rerank, diffusion (digits), the tools and the OpenAI (and
MCP) gateway behind a real Envoy (`aimesh up --edge`), on free ports, with a real OTLP
collector receiving the spans of every process, Envoy included. One key file (KEYS,
digests only) serves the gateway, which checks its own keys (one tenant with a tiny
quota), and the edge's authorizer for every other route, beside the edge's clear-text
API_KEY (tenant key-1)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest_asyncio

from mesh.edge.process import wait_ready
from tests.conftest import (
    eventually,
    free_port,
    start_collector,
    start_mesh,
    stop_mesh,
    subprocess_env,
    wait_all_serving,
)
from tests.services.gateway.conftest import write_keys

SERVICES = (
    "generation", "tokenizer", "prefill", "decode", "embedder", "rerank", "diffusion", "gateway",
    "tools",
)  # fmt: skip
API_KEY = "test-edge-key"
# The one browser origin the edge grants cross-origin calls (edge.cors_allow_origins).
BROWSER_ORIGIN = "http://app.example.test"
# The keys: key -> (tenant, scopes). "tiny" and "paced" may send one request per
# LIMIT_WINDOW_S (paced is tests/edge/test_tenancy.py's own), "frugal" has a budget of
# FRUGAL_BUDGET tokens: limits the gateway, the edge and the router read from one file.
GATEWAY_KEYS = {
    "sk-everything": ("acme", ["generate", "embed", "images"]),
    "sk-embed-only": ("embedco", ["embed"]),
    "sk-tiny": ("tiny", ["generate", "embed"]),
    "sk-paced": ("paced", ["generate", "embed"]),
    "sk-frugal": ("frugal", ["generate", "embed"]),
    "sk-reader": ("reader", ["read", "embed"]),
    "sk-writer": ("writer", ["read", "write"]),
    "sk-admin": ("ops", ["admin", "read"]),
    "sk-tools": ("toolco", ["read", "generate"]),
}
LIMIT_WINDOW_S = 6
FRUGAL_BUDGET = 120
TENANT_LIMITS = {
    "tiny": {"requests_per_minute": 1},
    "paced": {"requests_per_minute": 1},
    "frugal": {"token_budget": FRUGAL_BUDGET},
}


@dataclass
class Edge:
    port: int
    admin_port: int
    metrics_port: int
    ports: dict[str, int]
    http_port: int  # the gateway's own HTTP port, behind Envoy
    spans: Path  # the OTLP collector's debug log
    access_log: Path  # Envoy's stdout: one JSON line per request
    keys: Path  # the key file the gateway and the edge's authorizer share
    deployments: Path  # the model registry the generation router follows

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def embed_as_logged(edge: Edge, headers: dict[str, str]) -> dict:
    """POST /v1/embed with `headers` (and a user agent of its own), which must succeed, and
    its line of Envoy's access log: what Envoy believed about the request."""
    marker = secrets.token_hex(8)
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        reply = await client.post(
            "/v1/embed", headers={**headers, "user-agent": marker}, json={"inputs": ["hello"]}
        )
    assert reply.status_code == 200, reply.text

    def logged() -> list[dict]:
        lines = edge.access_log.read_text().splitlines()
        return [json.loads(line) for line in lines if marker in line]

    await eventually(lambda: bool(logged()), timeout_s=30)
    (line,) = logged()
    return line


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def edge(tmp_path_factory) -> AsyncIterator[Edge]:
    logs = tmp_path_factory.mktemp("edge-logs")
    spans = logs / "spans.log"
    collector, otlp_port = await start_collector(spans)
    ports = {name: free_port() for name in SERVICES}
    keys = logs / "keys.json"
    write_keys(keys, GATEWAY_KEYS, TENANT_LIMITS)
    edge = Edge(
        free_port(),
        free_port(),
        free_port(),
        ports,
        free_port(),
        spans,
        logs / "envoy.log",
        keys,
        logs / "deployments.json",
    )
    env = subprocess_env(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
        OTEL_BSP_SCHEDULE_DELAY="200",
        AIMESH_DEPLOYMENTS=str(edge.deployments),
        AIMESH_EDGE__PORT=str(edge.port),
        AIMESH_EDGE__ADMIN_PORT=str(edge.admin_port),
        AIMESH_EDGE__AUTHORIZER_PORT=str(free_port()),
        AIMESH_EDGE__API_KEYS_FILE=str(keys),
        AIMESH_EDGE__METRICS_PORT=str(edge.metrics_port),
        AIMESH_EDGE__API_KEYS=f'["{API_KEY}"]',
        AIMESH_EDGE__CORS_ALLOW_ORIGINS=f'["{BROWSER_ORIGIN}"]',
        **{f"AIMESH_SERVICES__{name.upper()}__PORT": str(port) for name, port in ports.items()},
        **{f"AIMESH_SERVICES__{name.upper()}__METRICS_PORT": "0" for name in SERVICES},
        AIMESH_SERVICES__DIFFUSION__MODELS='["digits"]',
        AIMESH_SERVICES__DIFFUSION__DEVICE="cpu",
        AIMESH_SERVICES__GATEWAY__HTTP_PORT=str(edge.http_port),
        AIMESH_SERVICES__GATEWAY__API_KEYS_FILE=str(keys),
        AIMESH_LIMITS__TENANTS_FILE=str(keys),
        AIMESH_LIMITS__STORE=f"sqlite:{logs / 'limits.sqlite'}",
        AIMESH_LIMITS__WINDOW_S=str(LIMIT_WINDOW_S),
    )
    only = [arg for name in SERVICES for arg in ("--only", name)]
    process = await start_mesh(*only, "--edge", "--log-dir", str(logs), env=env)
    try:
        await wait_all_serving(ports)
        if not await wait_ready(process, edge.admin_port, timeout_s=60):
            raise AssertionError(f"envoy did not become ready:\n{edge.access_log.read_text()}")
        yield edge
    finally:
        collector.kill()
        await collector.wait()
        await stop_mesh(process)
