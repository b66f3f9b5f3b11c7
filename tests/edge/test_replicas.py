"""Two embedder replicas behind the real Envoy: one is killed, Envoy stops sending it
traffic (health checks and outlier detection) and every call still succeeds."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.edge import process as envoy_process
from tests.conftest import VENV_BIN, eventually, free_port, subprocess_env

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


async def test_a_killed_replica_is_ejected_and_traffic_continues(serve_process, tmp_path):
    replicas = [await serve_process("embedder") for _ in range(2)]
    edge_port, admin_port = free_port(), free_port()
    config = tmp_path / "envoy.yaml"
    render = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "edge", "render", "--only", "embedder", "--out", str(config),
        env=subprocess_env(
            AIMESH_SERVICES__EMBEDDER__TARGET="ipv4:"
            + ",".join(replica.target for replica in replicas),
            AIMESH_EDGE__PORT=str(edge_port),
            AIMESH_EDGE__ADMIN_PORT=str(admin_port),
            AIMESH_EDGE__METRICS_PORT="0",
            AIMESH_EDGE__HEALTH_CHECK_INTERVAL_S="0.5",
            AIMESH_EDGE__API_KEYS=f'["{KEY}"]',
        ),
        stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert await render.wait() == 0
    envoy = await envoy_process.start("envoy", config, tmp_path / "envoy.log")
    try:
        assert await envoy_process.wait_ready(envoy, admin_port, timeout_s=30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{edge_port}") as channel:
            stub = embedder_pb2_grpc.EmbedderServiceStub(channel)
            victim, survivor = replicas
            for index in range(50):
                await embed(stub, f"warm {index}")
                if all(successes(admin_port, r.port) for r in replicas):
                    break
            assert all(successes(admin_port, r.port) for r in replicas), "both replicas serve"
            before = successes(admin_port, survivor.port)
            victim.process.kill()
            await victim.process.wait()
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
    finally:
        await envoy_process.stop(envoy)
