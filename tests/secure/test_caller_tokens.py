"""`aimesh up --tls --caller-tokens --edge`: the mesh as behind sidecars that end TLS.
Processes speak plaintext and prove who calls by tokens signed with their keys
(mesh/caller_token.py); Envoy's token comes from the edge's authorizer. Retrieval and the
embedder are enough for two hops behind the edge."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.authz import OPERATOR
from mesh.client import create_channel
from mesh.config import MeshSettings, TlsSettings
from tests.conftest import free_port, running_mesh, subprocess_env
from tests.services.tools.conftest import fill_knowledge

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

SERVICES = ("embedder", "retrieval")
API_KEY = "token-edge-key"
SEARCH = retrieval_pb2.SearchRequest(collection="knowledge", query="sorting a list", top_k=2)


@dataclass
class TokenMesh:
    ports: dict[str, int]
    edge_port: int
    pki: Path

    def as_(self, identity: str) -> MeshSettings:
        """`identity`'s settings as `aimesh up --tls --caller-tokens` gives them."""
        tls = TlsSettings(
            cert_file=self.pki / f"{identity}.pem",
            key_file=self.pki / f"{identity}.key",
            ca_file=self.pki / "ca.pem",
            caller_tokens=True,
        )
        return MeshSettings(tls=tls)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tmp_path_factory) -> AsyncIterator[TokenMesh]:
    started = TokenMesh(
        ports={name: free_port() for name in SERVICES},
        edge_port=free_port(),
        pki=tmp_path_factory.mktemp("token-pki"),
    )
    env = subprocess_env(
        AIMESH_EDGE__PORT=str(started.edge_port),
        AIMESH_EDGE__ADMIN_PORT=str(free_port()),
        AIMESH_EDGE__AUTHORIZER_PORT=str(free_port()),
        AIMESH_EDGE__METRICS_PORT="0",
        AIMESH_EDGE__API_KEYS=f'["{API_KEY}"]',
        AIMESH_SERVICES__RETRIEVAL__PATH=str(tmp_path_factory.mktemp("token-kb")),
        **{f"AIMESH_SERVICES__{n.upper()}__PORT": str(p) for n, p in started.ports.items()},
        **{f"AIMESH_SERVICES__{n.upper()}__METRICS_PORT": "0" for n in SERVICES},
    )
    only = [arg for name in SERVICES for arg in ("--only", name)]
    async with running_mesh(
        *only, "--tls", "--caller-tokens", "--tls-dir", str(started.pki), "--edge",
        "--log-dir", str(tmp_path_factory.mktemp("token-logs")),
        env=env,
    ) as said:  # fmt: skip
        assert b"plaintext with signed caller tokens" in said
        await fill_knowledge(f"127.0.0.1:{started.ports['retrieval']}", started.as_(OPERATOR))
        yield started


async def search(target: str, settings: MeshSettings, metadata=()) -> retrieval_pb2.SearchResponse:
    async with create_channel(target, settings) as channel:
        return await search_on(channel, metadata)


async def search_on(channel: grpc.aio.Channel, metadata=()) -> retrieval_pb2.SearchResponse:
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
    return await stub.Search(SEARCH, timeout=60, metadata=metadata)


async def test_through_the_edge_every_hop_proves_its_caller(mesh: TokenMesh):
    """A client with an API key over TLS to Envoy (trusting the CA up made; plaintext
    upstream, the authorizer's token naming `edge`) to retrieval, which calls the embedder
    with its own token. A token the client sends of its own is replaced by the
    authorizer's."""
    edge = f"127.0.0.1:{mesh.edge_port}"
    key = ("authorization", f"Bearer {API_KEY}")
    credentials = grpc.ssl_channel_credentials((mesh.pki / "ca.pem").read_bytes())
    async with grpc.aio.secure_channel(edge, credentials) as channel:
        found = await search_on(channel, (key,))
        assert found.hits and found.hits[0].id
        forged = ("x-aimesh-caller-token", "forged")
        assert (await search_on(channel, (key, forged))).hits


async def test_direct_callers_need_a_token_of_an_allowed_identity(mesh: TokenMesh):
    retrieval = f"127.0.0.1:{mesh.ports['retrieval']}"
    assert (await search(retrieval, mesh.as_(OPERATOR))).hits
    with pytest.raises(grpc.aio.AioRpcError) as anonymous:
        await search(retrieval, MeshSettings())  # plaintext, no token
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as embedder:
        await search(retrieval, mesh.as_("embedder"))  # a real token, not on the list
    assert embedder.value.code() == grpc.StatusCode.PERMISSION_DENIED
