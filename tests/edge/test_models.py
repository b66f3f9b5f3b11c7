"""The model registry through the edge: `aimesh models` with an admin key changes what the
router serves, a read key lists but cannot change and sees no artifact paths, and an
OpenAI client's `user` picks its canary bucket (the response's system_fingerprint names
the version that served it)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import grpc
import pytest

from aimesh.llm.v1 import models_pb2, models_pb2_grpc
from mesh.deployments import Artifact, FileStore, Version, bucket, register
from tests.conftest import subprocess_env
from tests.edge.conftest import Edge
from tests.edge.test_openai import QUESTION, sdk

pytestmark = pytest.mark.system

MODEL = "chat"


def _models(edge: Edge, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`aimesh models ...` as an operator runs it against the edge."""
    return subprocess.run(
        [sys.executable, "-m", "mesh.cli", "models", *args, "--edge", edge.target],
        env=subprocess_env(AIMESH_API_KEY=key, OTEL_TRACES_EXPORTER="none"),
        capture_output=True,
        text=True,
        timeout=300,
    )


async def _listed(edge: Edge, model: str, limit_s: float = 60) -> None:
    """Until the gateway's catalog (GetInfo of the router, polled) names `model`."""
    deadline = time.monotonic() + limit_s
    async with sdk(edge) as client:
        while model not in [m.id for m in (await client.models.list()).data]:
            assert time.monotonic() < deadline, f"/v1/models never listed {model!r}"
            await asyncio.sleep(0.5)


async def test_an_admin_key_changes_the_registry_through_the_edge(edge):
    store = FileStore(edge.deployments)
    # Two versions on the router's own workers: registering what the mesh runs costs nothing.
    for name in ("v1", "v2"):
        store.update(lambda s, n=name: register(s, MODEL, Version(name=n, engine="torch"), "test"))
    activated = _models(edge, "sk-admin", "activate", MODEL, "v1", "--reason", "first")
    assert activated.returncode == 0, activated.stderr
    assert f"activate {MODEL}: - -> v1" in activated.stdout
    refused = _models(edge, "sk-reader", "canary", MODEL, "v2", "100")
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
    listed = _models(edge, "sk-reader", "list")
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"{MODEL}\s.*v1", listed.stdout), listed.stdout
    canary = _models(edge, "sk-admin", "canary", MODEL, "v2", "100")
    assert canary.returncode == 0 and "v2@100%" in canary.stdout, canary.stderr

    await _listed(edge, MODEL)
    assert bucket("alice") < 100
    async with sdk(edge) as client:
        with_user = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2, user="alice"
        )
        without = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert (with_user.system_fingerprint, without.system_fingerprint) == ("v2", "v1")

    rolled = _models(edge, "sk-admin", "rollback", MODEL)
    assert rolled.returncode == 0 and "v2@100% -> -" in rolled.stdout, rolled.stderr
    changes = [e for e in store.load().events if e.action != "register"]
    assert [(e.actor, e.action) for e in changes] == [
        ("tenant:ops", "activate"),
        ("tenant:ops", "canary"),
        ("tenant:ops", "rollback"),
    ]


async def test_artifact_paths_go_to_admin_keys_only(edge, tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 64)
    version = Version(name="v1", artifact=Artifact.of(weights), engine="torch")
    FileStore(edge.deployments).update(lambda s: register(s, "paths", version, "test"))
    seen = {}
    async with grpc.aio.insecure_channel(edge.target) as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        for key in ("sk-reader", "sk-admin"):
            metadata = (("authorization", f"Bearer {key}"),)
            listed = await stub.ListModels(
                models_pb2.ListModelsRequest(), metadata=metadata, timeout=30
            )
            got = await stub.GetModel(
                models_pb2.GetModelRequest(model="paths"), metadata=metadata, timeout=30
            )
            (from_list,) = [m for m in listed.models if m.name == "paths"]
            seen[key] = {v.artifact_path for m in (from_list, got.model) for v in m.versions}
            assert {v.artifact_sha256 for v in got.model.versions} == {version.artifact.sha256}
    assert seen == {"sk-reader": {""}, "sk-admin": {str(weights.resolve())}}
