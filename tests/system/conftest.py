"""System tests: the whole mesh as separate processes (`aimesh up`) on free ports, with a
small knowledge collection in a store of its own, started once for the package."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest_asyncio

from tests.conftest import (
    free_port,
    start_collector,
    start_mesh,
    stop_mesh,
    subprocess_env,
    wait_all_serving,
)
from tests.services.tools.conftest import fill_knowledge

SERVICES = (
    "agent", "tools", "generation", "tokenizer", "prefill", "decode",
    "embedder", "retrieval", "rerank", "diffusion",
)  # fmt: skip


@dataclass
class Mesh:
    env: dict[str, str]
    ports: dict[str, int]
    spans: Path  # everything the OTLP collector received, as its debug log prints it

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def mesh(tmp_path_factory) -> AsyncIterator[Mesh]:
    ports = {name: free_port() for name in SERVICES}
    spans = tmp_path_factory.mktemp("otlp") / "spans.log"
    collector, otlp_port = await start_collector(spans)
    env = subprocess_env(
        AIMESH_SERVICES__RETRIEVAL__PATH=str(tmp_path_factory.mktemp("agent-kb")),
        AIMESH_SERVICES__DIFFUSION__MODELS="digits",
        AIMESH_SERVICES__AGENT__RUN_STORE=str(tmp_path_factory.mktemp("agent-runs") / "runs.db"),
        # The model's plan is what these tests check, not how fast it comes: on an
        # AVX2-only 2-core EPYC the first plans took over the 5 s default (falling back
        # to the rules); a run's own deadline still bounds it.
        AIMESH_SERVICES__AGENT__PLAN_TIMEOUT_S="60",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
        OTEL_BSP_SCHEDULE_DELAY="200",
        **{f"AIMESH_SERVICES__{name.upper()}__PORT": str(port) for name, port in ports.items()},
        **{f"AIMESH_SERVICES__{name.upper()}__METRICS_PORT": "0" for name in SERVICES},
    )
    only = [arg for name in SERVICES for arg in ("--only", name)]
    process = await start_mesh(*only, env=env)
    try:
        await wait_all_serving(ports)
        await fill_knowledge(f"127.0.0.1:{ports['retrieval']}")
        yield Mesh(env, ports, spans)
    finally:
        collector.kill()
        await collector.wait()
        await stop_mesh(process)
