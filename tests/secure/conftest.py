"""The whole mesh under `aimesh up --tls --edge`: every process on certificates of a
throwaway CA, each checking its callers' identities against its allow-lists, and Envoy
reaching the services over mutual TLS as `edge`; clients outside come in through Envoy
over TLS (trusting that CA) with an API key, or directly with a certificate of the CA."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest_asyncio

from mesh.authz import OPERATOR
from mesh.config import MeshSettings, TlsSettings
from tests.conftest import free_port, running_mesh, subprocess_env
from tests.services.tools.conftest import fill_knowledge

SERVICES = (
    "agent", "tools", "generation", "tokenizer", "prefill", "decode",
    "embedder", "retrieval", "rerank", "diffusion", "gateway",
)  # fmt: skip
API_KEY = "secure-edge-key"


@dataclass
class SecureMesh:
    ports: dict[str, int]
    edge_port: int
    http_port: int  # the gateway's HTTP API, behind Envoy
    pki: Path  # the CA and every certificate `aimesh up --tls` made
    env: dict[str, str]

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def edge(self) -> str:
        return f"127.0.0.1:{self.edge_port}"

    def tls(self, identity: str) -> TlsSettings:
        """The certificate `aimesh up --tls` made for `identity`."""
        return TlsSettings(
            cert_file=self.pki / f"{identity}.pem",
            key_file=self.pki / f"{identity}.key",
            ca_file=self.pki / "ca.pem",
        )

    def as_(self, identity: str) -> MeshSettings:
        return MeshSettings(tls=self.tls(identity))

    @property
    def ca_file(self) -> Path:
        """What `aimesh up --tls` tells clients outside to trust the edge by."""
        return self.pki / "ca.pem"

    def edge_channel(self) -> grpc.aio.Channel:
        """A client outside: TLS to the edge, trusting the CA, no certificate of its own."""
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_file.read_bytes())
        return grpc.aio.secure_channel(self.edge, credentials)

    def edge_http(self, **options) -> httpx.AsyncClient:
        """An HTTP client outside, as edge_channel: https, trusting the CA."""
        verify = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.AsyncClient(verify=verify, **options)


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def secure(tmp_path_factory) -> AsyncIterator[SecureMesh]:
    logs = tmp_path_factory.mktemp("secure-logs")
    mesh = SecureMesh(
        ports={name: free_port() for name in SERVICES},
        edge_port=free_port(),
        http_port=free_port(),
        pki=tmp_path_factory.mktemp("pki"),
        env={},
    )
    mesh.env = subprocess_env(
        AIMESH_EDGE__PORT=str(mesh.edge_port),
        AIMESH_EDGE__ADMIN_PORT=str(free_port()),
        AIMESH_EDGE__AUTHORIZER_PORT=str(free_port()),
        AIMESH_EDGE__METRICS_PORT="0",
        AIMESH_EDGE__API_KEYS=f'["{API_KEY}"]',
        AIMESH_SERVICES__GATEWAY__HTTP_PORT=str(mesh.http_port),
        AIMESH_SERVICES__RETRIEVAL__PATH=str(tmp_path_factory.mktemp("secure-kb")),
        AIMESH_SERVICES__DIFFUSION__MODELS='["digits"]',
        AIMESH_SERVICES__DIFFUSION__DEVICE="cpu",
        **{f"AIMESH_SERVICES__{n.upper()}__PORT": str(port) for n, port in mesh.ports.items()},
        **{f"AIMESH_SERVICES__{name.upper()}__METRICS_PORT": "0" for name in SERVICES},
    )
    only = [arg for name in SERVICES for arg in ("--only", name)]
    async with running_mesh(
        *only, "--tls", "--tls-dir", str(mesh.pki), "--edge", "--log-dir", str(logs),
        env=mesh.env,
    ):  # fmt: skip
        await fill_knowledge(mesh.target("retrieval"), mesh.as_(OPERATOR))
        yield mesh
