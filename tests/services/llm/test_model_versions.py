"""Models as versioned deployments, on real processes: two versions of one registered
model (the embedded SmolLM2 in float32 on one prefill+decode pair, in bfloat16 on
another), two generation routers on one registry file.

Activate and rollback under a steady stream fail no request and move every new request;
the canary splits users by sha256(user id) % 100 alike on both routers and across a
router restart; a version whose workers serve other weights is refused before it serves;
a canary whose decode worker dies is rolled back by the router's rule, evented.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, models_pb2, models_pb2_grpc
from mesh import caller
from mesh.artifacts import write_manifest
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.deployments import Artifact, FileStore, Version, activate, bucket, register
from mesh.errors import field_violations
from mesh.info import get_info
from services.generation.models import RULE_ACTOR
from services.generation.servicer import GENERATION
from services.llm.artifacts import DEFAULT_NAME
from tests.conftest import free_port, subprocess_env
from tests.harness import ServiceProcesses
from tests.services.llm.conftest import MAX_BATCH, MAX_SEQ_LEN, stopping

pytestmark = pytest.mark.system

MODELS = models_pb2.DESCRIPTOR.services_by_name["ModelService"]
MODEL = "chat"
# The rule judges a canary on this many requests in its window (the default is 10).
RULE_MIN_REQUESTS = 4


@dataclass
class VersionsMesh:
    root: Path
    ports: dict[str, int]
    processes: ServiceProcesses
    registry: Path
    configs: dict[str, Path] = field(default_factory=dict)

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def channel(self, router: str = "generation") -> grpc.aio.Channel:
        return create_channel(self.target(router), MeshSettings(), services=[GENERATION, MODELS])

    def metrics(self, router: str = "generation") -> str:
        url = f"http://127.0.0.1:{self.ports[router + '_metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()


def _config(
    root: Path, name: str, ports: dict[str, int], dtype: str, router: str, pair: str = "a"
) -> Path:
    """The mesh config: a decode worker pulls KV from its own pair's prefill only."""
    path = root / f"{name}.toml"
    path.write_text(
        f'deployments = "{root / "deployments.json"}"\n'
        f"[engines.llm]\nmax_seq_len = {MAX_SEQ_LEN}\nmax_batch_size = {MAX_BATCH}\n"
        f'engine = "torch"\nprefill_engine = "torch"\ndtype = "{dtype}"\n'
        f"[services.tokenizer]\nport = {ports['tokenizer']}\n"
        f'[services.decode]\nprefill = ["127.0.0.1:{ports[f"prefill-{pair}"]}"]\n'
        f"[services.generation]\nmetrics_port = {ports[router + '_metrics']}\n"
        f'prefill = ["127.0.0.1:{ports["prefill-a"]}"]\n'
        f'decode = ["127.0.0.1:{ports["decode-a"]}"]\n'
        "registry_poll_s = 0.5\n"
        f"[services.generation.canary_rule]\nmin_requests = {RULE_MIN_REQUESTS}\n"
        # bfloat16 on these CPUs is slower than float32: only errors judge the canary here
        # (the TTFT signal is the unit tests').
        "ttft_p99_factor = 1000\n"
        "[services.generation.dependencies]\n"
        f'tokenizer = "127.0.0.1:{ports["tokenizer"]}"\n'
    )
    return path


def _other_weights(root: Path) -> Path:
    """A checked artifact that is not the model the workers serve."""
    directory = root / "other-weights"
    directory.mkdir()
    (directory / "config.json").write_text('{"note": "not the served model"}')
    write_manifest(directory, "test")
    return directory


@pytest.fixture(scope="module")
def versions_mesh(tmp_path_factory, model_dir) -> Iterator[VersionsMesh]:
    root = tmp_path_factory.mktemp("versions-mesh")
    names = ["tokenizer", "prefill-a", "decode-a", "prefill-b", "decode-b"]
    names += ["generation", "generation-2", "generation_metrics", "generation-2_metrics"]
    ports = {name: free_port() for name in names}
    mesh = VersionsMesh(root, ports, None, root / "deployments.json")  # type: ignore[arg-type]
    float32 = _config(root, "float32", ports, "float32", "generation")
    configs = {
        "float32": float32,
        "bfloat16": _config(root, "bfloat16", ports, "bfloat16", "generation", pair="b"),
        "router-2": _config(root, "router-2", ports, "float32", "generation-2"),
    }
    store = FileStore(mesh.registry)
    model_artifact = Artifact.of(model_dir)
    for name, engine, kind, artifact in (
        ("f32", "torch-float32", "a", model_artifact),
        ("bf16", "torch-bfloat16", "b", model_artifact),
        ("other-weights", "torch-float32", "a", Artifact.of(_other_weights(root))),
    ):
        workers = {w: [mesh.target(f"{w}-{kind}")] for w in ("prefill", "decode")}
        version = Version(name=name, artifact=artifact, engine=engine, workers=workers)
        store.update(lambda s, v=version: register(s, MODEL, v, "test"))
    store.update(lambda s: activate(s, MODEL, "f32", "test"))
    processes = ServiceProcesses(
        root, subprocess_env(AIMESH_CONFIG=str(float32), OTEL_TRACES_EXPORTER="none")
    )
    mesh.processes, mesh.configs = processes, configs
    bfloat16 = {"AIMESH_CONFIG": str(configs["bfloat16"])}
    try:
        processes.start_all(
            [
                ("tokenizer", "tokenizer", ports["tokenizer"], {}),
                ("prefill-a", "prefill", ports["prefill-a"], {}),
                ("decode-a", "decode", ports["decode-a"], {}),
                ("prefill-b", "prefill", ports["prefill-b"], bfloat16),
                ("decode-b", "decode", ports["decode-b"], bfloat16),
                ("generation", "generation", ports["generation"], {}),
                (
                    "generation-2",
                    "generation",
                    ports["generation-2"],
                    {"AIMESH_CONFIG": str(configs["router-2"])},
                ),
            ]
        )
        yield mesh
    finally:
        processes.close()


async def _generate(
    channel: grpc.aio.Channel, user: str = "", model: str = MODEL, deadline_s: float = 60
) -> generation_pb2.GenerationComplete:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    metadata = ((caller.USER_METADATA_KEY, user),) if user else ()
    call = stub.Generate(
        generation_pb2.GenerateRequest(prompt="Hello", model=model, stopping=stopping(3)),
        metadata=metadata,
        timeout=deadline_s,
    )
    complete = None
    async for message in call:
        if message.HasField("complete"):
            complete = message.complete
    assert complete is not None
    return complete


async def _model(channel: grpc.aio.Channel) -> models_pb2.Model:
    stub = models_pb2_grpc.ModelServiceStub(channel)
    return (await stub.GetModel(models_pb2.GetModelRequest(model=MODEL), timeout=10)).model


async def test_a_registered_model_is_listed_and_served_by_its_active_version(versions_mesh):
    async with versions_mesh.channel() as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        listed = await stub.ListModels(models_pb2.ListModelsRequest(), timeout=10)
        by_name = {model.name: model for model in listed.models}
        assert set(by_name) == {DEFAULT_NAME, MODEL}
        chat = by_name[MODEL]
        assert chat.active == "f32" and not chat.HasField("canary")
        states = {v.name: v.state for v in chat.versions}
        assert states == {"f32": "serving", "bf16": "", "other-weights": ""}
        complete = await _generate(channel)
        assert (complete.model, complete.model_version) == (MODEL, "f32")
        assert complete.decode_worker == versions_mesh.target("decode-a")
        own = await _generate(channel, model="")
        assert (own.model, own.model_version) == (DEFAULT_NAME, "")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(channel, model="gpt-17")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(refused.value)] == ["model"]
    # GetInfo names both, so the gateway's /v1/models lists both.
    info = await get_info(versions_mesh.target("generation"), timeout_s=5)
    assert [m.name for m in info.models] == [DEFAULT_NAME, MODEL]
    assert info.models[1].revision == "f32"


@dataclass
class Served:
    started: float
    ended: float
    version: str = ""
    decode: str = ""
    error: str = ""


async def _steady_stream(channel: grpc.aio.Channel, log: list[Served], stop: asyncio.Event):
    """Two callers in a loop until `stop`: every request's start, end and version."""

    async def caller() -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                complete = await _generate(channel)
                ended = time.monotonic()
                log.append(Served(started, ended, complete.model_version, complete.decode_worker))
            except grpc.aio.AioRpcError as error:
                log.append(Served(started, time.monotonic(), error=f"{error.code().name}"))

    await asyncio.gather(caller(), caller())


async def _until_served(log: list[Served], after: float, count: int, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while sum(s.started > after for s in log) < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests in {limit_s} s"
        await asyncio.sleep(0.05)


async def test_activate_and_rollback_under_a_steady_stream_fail_no_request(versions_mesh):
    mesh = versions_mesh
    log: list[Served] = []
    stop = asyncio.Event()
    async with mesh.channel() as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        stream = asyncio.create_task(_steady_stream(channel, log, stop))
        try:
            await _until_served(log, 0, 3)
            asked = time.monotonic()
            activated = (
                await stub.Activate(
                    models_pb2.ActivateRequest(model=MODEL, version="bf16", reason="test"),
                    timeout=180,
                )
            ).event
            moved = time.monotonic()
            await _until_served(log, moved, 4)
            asked_back = time.monotonic()
            rolled = (
                await stub.Rollback(
                    models_pb2.RollbackRequest(model=MODEL, reason="test"), timeout=180
                )
            ).event
            moved_back = time.monotonic()
            await _until_served(log, moved_back, 4)
        finally:
            stop.set()
            await stream
    assert [s.error for s in log if s.error] == []
    assert (activated.before, activated.after, activated.actor) == ("f32", "bf16", "mesh")
    assert (rolled.before, rolled.after) == ("bf16", "f32")
    assert 0 < activated.applied_s <= moved - asked
    assert 0 < rolled.applied_s <= moved_back - asked_back
    between = [s for s in log if s.started > moved and s.ended < asked_back]
    assert between and {(s.version, s.decode) for s in between} == {
        ("bf16", mesh.target("decode-b"))
    }
    after = [s for s in log if s.started > moved_back]
    assert after and {s.version for s in after} == {"f32"}
    # bf16 was warmed (one generation through its workers) before it took a request.
    warmed = re.search(
        r'^aimesh_llm_version_warm_start_seconds_count\{model="chat",version="bf16"\} (\S+)$',
        mesh.metrics(),
        re.MULTILINE,
    )
    assert warmed and float(warmed.group(1)) >= 1


async def _routes_alike(mesh: VersionsMesh, router: str, users: list[str], expected) -> None:
    async with mesh.channel(router) as channel:
        for user in users:
            complete = await _generate(channel, user=user)
            assert complete.model_version == expected[user], (router, user)


async def _following(mesh: VersionsMesh, router: str, canary: str, limit_s: float = 60) -> None:
    """Until `router` answers and routes by a canary of `canary` (empty: none)."""
    deadline = time.monotonic() + limit_s
    async with mesh.channel(router) as channel:
        while True:
            try:
                model = await _model(channel)
            except grpc.aio.AioRpcError as error:
                # A router just restarted: the connection is retried after a backoff.
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert time.monotonic() < deadline, f"{router} did not answer"
                await asyncio.sleep(0.2)
                continue
            serving = {v.name for v in model.versions if v.state == "serving"}
            now = model.canary.version if model.HasField("canary") else ""
            if now == canary and (not canary or canary in serving):
                return
            assert time.monotonic() < deadline, f"{router} did not follow the registry"
            await asyncio.sleep(0.2)


async def test_the_canary_splits_users_alike_on_two_routers_and_across_a_restart(versions_mesh):
    mesh = versions_mesh
    users = [f"user-{n}" for n in range(16)]
    expected = {user: "bf16" if bucket(user) < 30 else "f32" for user in users}
    assert set(expected.values()) == {"bf16", "f32"}  # both sides are exercised
    async with mesh.channel() as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        event = (
            await stub.SetCanary(
                models_pb2.SetCanaryRequest(model=MODEL, version="bf16", percent=30), timeout=180
            )
        ).event
    assert event.after == "bf16@30%"
    await _following(mesh, "generation-2", "bf16")
    await _routes_alike(mesh, "generation", users, expected)
    await _routes_alike(mesh, "generation-2", users, expected)
    # The registry outlives the router: restarted, it routes every user as before.
    mesh.processes.signal("generation-2", signal.SIGTERM)
    assert await mesh.processes.wait("generation-2") == 0
    await mesh.processes.start(
        "generation-2",
        "generation",
        mesh.ports["generation-2"],
        AIMESH_CONFIG=str(mesh.configs["router-2"]),
    )
    await _following(mesh, "generation-2", "bf16")
    await _routes_alike(mesh, "generation-2", users, expected)
    async with mesh.channel() as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        ended = (await stub.Rollback(models_pb2.RollbackRequest(model=MODEL), timeout=60)).event
    assert (ended.before, ended.after) == ("bf16@30%", "")
    await _following(mesh, "generation-2", "")


def _cli(mesh: VersionsMesh, *args: str) -> subprocess.CompletedProcess[str]:
    env = subprocess_env(
        AIMESH_CONFIG=str(mesh.configs["float32"]),
        AIMESH_SERVICES__GENERATION__PORT=str(mesh.ports["generation"]),
        OTEL_TRACES_EXPORTER="none",
    )
    return subprocess.run(
        [sys.executable, "-m", "mesh.cli", "models", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


async def test_a_version_whose_workers_serve_other_weights_is_refused_before_it_serves(
    versions_mesh,
):
    mesh = versions_mesh
    events = len(FileStore(mesh.registry).load().events)
    async with mesh.channel() as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Activate(
                models_pb2.ActivateRequest(model=MODEL, version="other-weights"), timeout=180
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not serve the artifact" in refused.value.details()
        assert (await _model(channel)).active == "f32"
        assert (await _generate(channel)).model_version == "f32"
    assert len(FileStore(mesh.registry).load().events) == events  # nothing recorded
    # The operator's command says the same, against the running mesh.
    said = _cli(mesh, "activate", MODEL, "other-weights")
    assert said.returncode == 1 and "FAILED_PRECONDITION" in said.stderr, said.stderr
    listed = _cli(mesh, "list")
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"chat\s.*f32", listed.stdout), listed.stdout


async def test_a_failing_canary_is_rolled_back_by_the_routers_rule(versions_mesh):
    """Runs last: it kills the canary's decode worker."""
    mesh = versions_mesh
    canary_users = [u for u in (f"user-{n}" for n in range(200)) if bucket(u) < 50][:8]
    async with mesh.channel() as channel:
        stub = models_pb2_grpc.ModelServiceStub(channel)
        await stub.SetCanary(
            models_pb2.SetCanaryRequest(model=MODEL, version="bf16", percent=50), timeout=180
        )
        assert (await _generate(channel, user=canary_users[0])).model_version == "bf16"
        mesh.processes.signal("decode-b", signal.SIGKILL)
        await mesh.processes.wait("decode-b")
        failed = 0
        deadline = time.monotonic() + 120
        while (await _model(channel)).HasField("canary"):
            assert time.monotonic() < deadline, "the rule did not roll the canary back"
            try:
                user = canary_users[failed % len(canary_users)]
                await _generate(channel, user=user, deadline_s=20)
            except grpc.aio.AioRpcError:
                failed += 1
        # The rule judges every canary request in its window, the earlier tests' successes
        # included, so how many failures it takes varies; one at least.
        assert failed >= 1
        for user in canary_users:
            assert (await _generate(channel, user=user)).model_version == "f32"
    rolled = FileStore(mesh.registry).load().events[-1]
    assert (rolled.actor, rolled.action, rolled.before) == (RULE_ACTOR, "rollback", "bf16@50%")
    assert "error rate" in rolled.reason
    assert re.search(
        r'^aimesh_llm_canary_rollbacks_total\{model="chat",signal="errors",version="bf16"\} 1\.0$',
        mesh.metrics(),
        re.MULTILINE,
    )
