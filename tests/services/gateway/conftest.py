"""Gateway fixtures: the gateway in this process, in front of scripted stand-ins for
generation and the embedder (tests/services/gateway/fakes.py), over real loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from mesh.config import LimitsSettings, MeshSettings, ServiceSettings
from mesh.keys import digest
from mesh.server import MeshServer
from services.gateway.http_server import HttpServer
from services.gateway.service import setup
from tests.services.gateway.fakes import (
    FakeDiffusion,
    FakeEmbedder,
    FakeGeneration,
    fake_diffusion,
    fake_embedder,
    fake_generation,
)

# key -> (tenant, scopes)
KEYS = {
    "sk-everything": ("acme", ["generate", "embed", "images"]),
    "sk-embed-only": ("embedco", ["embed"]),
}
KEY = "sk-everything"


def write_keys(
    path: Path,
    keys: dict[str, tuple[str, list[str]]],
    tenants: dict[str, dict[str, int]] | None = None,
) -> None:
    """The key file; `tenants` maps a tenant to its limits."""
    entries = [
        {"sha256": digest(key), "tenant": tenant, "scopes": scopes}
        for key, (tenant, scopes) in keys.items()
    ]
    path.write_text(json.dumps({"keys": entries, "tenants": tenants or {}}))


@dataclass
class Gateway:
    server: MeshServer
    url: str
    generation: FakeGeneration
    embedder: FakeEmbedder
    diffusion: FakeDiffusion
    keys_file: Path
    listener: HttpServer
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def sdk(self, key: str = KEY, max_retries: int = 0) -> openai.AsyncOpenAI:
        """The real openai SDK (retries off unless asked for, so that a test sees the
        first answer), closed with the gateway."""
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=max_retries)
        self.clients.append(client)
        return client

    def http(self, key: str | None = KEY) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)


async def start_gateway(
    tmp_path: Path,
    *,
    keys: dict[str, tuple[str, list[str]]] = KEYS,
    tenants: dict[str, dict[str, int]] | None = None,
    dependencies: dict[str, str] | None = None,
    limits: dict[str, object] | None = None,
    **gateway_settings: object,
) -> tuple[Gateway, list[MeshServer]]:
    """The gateway on `keys` (a file every gateway started on `tmp_path` shares), its
    tenants' limits read from the same file, the meter's store in this process unless
    `limits` says otherwise ([limits] settings)."""
    generation, embedder, diffusion = FakeGeneration(), FakeEmbedder(), FakeDiffusion()
    fakes = [
        await fake_generation(generation),
        await fake_embedder(embedder),
        await fake_diffusion(diffusion),
    ]
    keys_file = tmp_path / "keys.json"
    if not keys_file.exists():  # a second gateway on the same directory shares the file
        write_keys(keys_file, keys, tenants)
    settings = MeshSettings(
        limits=LimitsSettings(**{"tenants_file": keys_file, "store": "memory", **(limits or {})}),
        services={
            "gateway": ServiceSettings(
                metrics_port=0,
                grace_s=2,
                dependencies={
                    "generation": f"127.0.0.1:{fakes[0].port}",
                    "embedder": f"127.0.0.1:{fakes[1].port}",
                    "diffusion": f"127.0.0.1:{fakes[2].port}",
                    **(dependencies or {}),
                },
                http_port=0,
                api_keys_file=str(keys_file),
                poll_interval_s=0.05,
                **gateway_settings,
            )
        },
    )
    server = MeshServer.for_service("gateway", settings, port=0)
    http = await setup(server)
    await server.start()
    url = f"http://127.0.0.1:{http.port}"
    gateway = Gateway(server, url, generation, embedder, diffusion, keys_file, http)
    return gateway, [server, *fakes]


@asynccontextmanager
async def running_gateway(tmp_path: Path, **gateway_settings: object) -> AsyncIterator[Gateway]:
    """start_gateway's gateway, its clients closed and every server drained at the end."""
    started, servers = await start_gateway(tmp_path, **gateway_settings)
    try:
        yield started
    finally:
        for client in started.clients:
            await client.close()
        for server in servers:
            await server.drain(0)


@pytest.fixture
async def gateway(tmp_path) -> AsyncIterator[Gateway]:
    async with running_gateway(tmp_path) as started:
        yield started
