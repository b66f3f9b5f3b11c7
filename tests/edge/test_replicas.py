"""Embedder replicas behind a real Envoy of the test's own: a killed replica is ejected
while every call still succeeds, and the edge's rate limit answers RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.edge import process as envoy_process
from tests.conftest import VENV_BIN, eventually, free_port, subprocess_env

pytestmark = pytest.mark.system

KEY = "replica-test-key"


def admin_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        return json.loads(reply.read())


def hosts(admin_port: int) -> dict[int, dict]:
    """The embedder cluster's hosts by port, as Envoy's admin API reports them."""
    clusters = admin_json(admin_port, "/clusters?format=json")["cluster_statuses"]
    (embedder,) = [c for c in clusters if c["name"] == "embedder"]
    return {
        host["address"]["socket_address"]["port_value"]: host for host in embedder["host_statuses"]
    }


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def health(admin_port: int, port: int) -> dict:
    return hosts(admin_port)[port]["health_status"]


def successes(admin_port: int, port: int) -> int:
    stats = {s["name"]: int(s.get("value", 0)) for s in hosts(admin_port)[port]["stats"]}
    return stats.get("rq_success", 0)


async def embed(stub, text: str) -> embedder_pb2.EmbedResponse:
    return await stub.Embed(
        embedder_pb2.EmbedRequest(inputs=[text]),
        metadata=(("x-api-key", KEY),),
        timeout=30,
    )


@dataclass
class Edge:
    port: int
    admin_port: int


EdgeFactory = Callable[..., AbstractAsyncContextManager[Edge]]


@pytest.fixture
def edge_over(tmp_path: Path) -> EdgeFactory:
    """Envoy in front of the given embedder targets, configured by `aimesh edge render`,
    with its key checker (`aimesh edge authorize`) beside it."""

    @asynccontextmanager
    async def start(targets: list[str], **edge_settings: str) -> AsyncIterator[Edge]:
        edge = Edge(free_port(), free_port())
        config = tmp_path / "envoy.yaml"
        authorizer_port = free_port()
        env = subprocess_env(
            AIMESH_SERVICES__EMBEDDER__TARGET="ipv4:" + ",".join(targets),
            AIMESH_EDGE__PORT=str(edge.port),
            AIMESH_EDGE__ADMIN_PORT=str(edge.admin_port),
            AIMESH_EDGE__METRICS_PORT="0",
            AIMESH_EDGE__AUTHORIZER_PORT=str(authorizer_port),
            AIMESH_EDGE__API_KEYS=f'["{KEY}"]',
            **{f"AIMESH_EDGE__{key.upper()}": value for key, value in edge_settings.items()},
        )
        aimesh = str(VENV_BIN / "aimesh")
        render = await asyncio.create_subprocess_exec(
            aimesh, "edge", "render", "--only", "embedder", "--out", str(config),
            env=env, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert await render.wait() == 0
        checker = await asyncio.create_subprocess_exec(aimesh, "edge", "authorize", env=env)
        envoy = await envoy_process.start("envoy", config, tmp_path / "envoy.log")
        try:
            await eventually(lambda: port_open(authorizer_port), timeout_s=30, interval_s=0.1)
            assert await envoy_process.wait_ready(envoy, edge.admin_port, timeout_s=30)
            yield edge
        finally:
            await envoy_process.stop(envoy)
            await envoy_process.stop(checker)

    return start


async def test_a_killed_replica_is_ejected_and_traffic_continues(serve_process, edge_over):
    replicas = [await serve_process("embedder") for _ in range(2)]
    targets = [replica.target for replica in replicas]
    async with (
        edge_over(targets, health_check_interval_s="0.5") as edge,
        grpc.aio.insecure_channel(f"127.0.0.1:{edge.port}") as channel,
    ):
        admin_port = edge.admin_port
        stub = embedder_pb2_grpc.EmbedderServiceStub(channel)
        victim, survivor = replicas
        for index in range(50):
            await embed(stub, f"warm {index}")
            if all(successes(admin_port, r.port) for r in replicas):
                break
        assert all(successes(admin_port, r.port) for r in replicas), "both replicas serve"
        before = successes(admin_port, survivor.port)
        victim.signal(signal.SIGKILL)
        await victim.wait()
        results = [await embed(stub, f"after {index}") for index in range(30)]
        assert all(len(r.embeddings[0].values) == 384 for r in results)
        assert successes(admin_port, survivor.port) - before == len(results)

        def victim_out() -> bool:
            status = health(admin_port, victim.port)
            return bool(
                status.get("failed_active_health_check") or status.get("failed_outlier_check")
            )

        await eventually(victim_out, timeout_s=15, interval_s=0.25)
        assert not health(admin_port, survivor.port).get("failed_active_health_check")


async def test_past_the_rate_limit_the_edge_answers_resource_exhausted(serve_process, edge_over):
    replica = await serve_process("embedder")
    async with (
        edge_over([replica.target], rate_limit_per_s="1", rate_limit_burst="3") as edge,
        grpc.aio.insecure_channel(f"127.0.0.1:{edge.port}") as channel,
    ):
        stub = embedder_pb2_grpc.EmbedderServiceStub(channel)
        outcomes = await asyncio.gather(
            *(embed(stub, f"burst {index}") for index in range(8)), return_exceptions=True
        )
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert 1 <= len(outcomes) - len(refused) <= 4
    assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
