"""The router's registry follower (services/generation/versions.py) on a real registry
file and a real redis-server: a registry that goes bad (a field it does not know, cut
short, gone, its Redis stopped) leaves the table served as it was, is said once and
reported (aimesh_store_state, the `generation.registry` health name), and the first valid
revision after it is applied; a version whose artifact changed since it was registered
is refused, workers or not; artifact paths go to operators and admin keys only.

The router's own workers are stand-ins that must not be called: a version without
workers of its own is served by them, so following the registry needs no model."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from aimesh.llm.v1 import models_pb2
from mesh.deployments import (
    Artifact,
    FileStore,
    RedisStore,
    RegistryInvalid,
    Version,
    activate,
    register,
)
from mesh.edge.authorizer import SCOPES_HEADER
from mesh.store_health import StoreHealth
from services.generation.models import SCOPES_METADATA_KEY, ModelServicer
from services.generation.versions import Pool, Versions
from tests.conftest import metric
from tests.services.llm.test_router_validation import NoWork

pytestmark = pytest.mark.unit

MODEL = "chat"
HEALTH_NAME = "generation.registry"


async def _warm(pool: Pool) -> None:
    """Stands in for the warm generation: the own workers are not there."""


def _following(store, health: HealthServicer | None = None) -> Versions:
    return Versions(
        store=store,
        own=Pool("own", "", NoWork(), NoWork(), NoWork()),
        channels=NoWork(),
        tls=None,
        poll_interval_s=0.05,
        warm_timeout_s=30,
        warm_up=_warm,
        watch=lambda task: None,
        unwatch=lambda task: None,
        health=StoreHealth("registry", health=health or HealthServicer(), service="generation"),
    )


def _register(store, name: str, artifact: Path | None = None) -> None:
    version = Version(name=name, artifact=None if artifact is None else Artifact.of(artifact))
    store.update(lambda s: register(s, MODEL, version, "test"))


def _activate(store, name: str) -> None:
    store.update(lambda s: activate(s, MODEL, name, "test"))


async def _health(servicer: HealthServicer) -> str:
    checked = await servicer.Check(health_pb2.HealthCheckRequest(service=HEALTH_NAME), None)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(checked.status)


def _state(state: str) -> float:
    return metric("aimesh_store_state", store="registry", state=state)


def _said(caplog, message: str) -> int:
    return sum(record.getMessage() == message for record in caplog.records)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda path: path.write_text(path.read_text().replace('"revision"', '"x": 1, "revision"')),
        lambda path: path.write_bytes(path.read_bytes()[:100]),
        lambda path: path.unlink(),
    ],
    ids=["unknown-field", "cut-short", "deleted"],
)
async def test_a_spoiled_registry_file_keeps_the_last_valid_table_until_fixed(
    tmp_path, caplog, spoil
):
    caplog.set_level(logging.INFO)
    store = FileStore(tmp_path / "deployments.json")
    for name in ("v1", "v2"):
        _register(store, name)
    _activate(store, "v1")
    health = HealthServicer()
    versions = _following(store, health)
    assert await versions.look()
    assert versions.route(MODEL, "").version == "v1"
    assert await _health(health) == "SERVING" and _state("ok") == 1
    good = store.path.read_bytes()

    spoil(store.path)
    for _ in range(5):  # looks again and again, as the follower does
        assert not await versions.look()
        assert versions.route(MODEL, "").version == "v1"
        assert versions.knows(MODEL)
    assert await _health(health) == "NOT_SERVING"
    assert (_state("invalid"), _state("ok")) == (1, 0)
    assert _said(caplog, "store failing; this process keeps serving and retries") == 1

    store.path.write_bytes(good)  # fixed (restored), then changed again
    _activate(store, "v2")
    assert await versions.look()
    assert versions.route(MODEL, "").version == "v2"
    assert await _health(health) == "SERVING" and _state("ok") == 1
    assert _said(caplog, "store answers again") == 1


async def test_the_follower_outlives_a_registry_that_stays_bad(tmp_path):
    """The background task itself: it backs off and goes on, it never ends."""
    store = FileStore(tmp_path / "deployments.json")
    _register(store, "v1")
    _activate(store, "v1")
    health = HealthServicer()
    versions = _following(store, health)
    store.path.write_text("{")
    following = asyncio.create_task(versions.follow())
    try:
        give_up = asyncio.get_running_loop().time() + 10
        while versions.health.failures < 3:
            assert not following.done(), following
            assert asyncio.get_running_loop().time() < give_up, "the follower did not retry"
            await asyncio.sleep(0.05)
        assert not following.done()
        assert await _health(health) == "NOT_SERVING"
        _activate_over(store)
        while not versions.knows(MODEL):
            assert asyncio.get_running_loop().time() < give_up, "the fix was not applied"
            await asyncio.sleep(0.05)
        assert await _health(health) == "SERVING"
    finally:
        following.cancel()


def _activate_over(store: FileStore) -> None:
    """What an operator does to a spoiled file: writes a valid registry over it."""
    store.path.unlink()
    _register(store, "v1")
    _activate(store, "v1")


@pytest.mark.service  # a real redis-server, killed
async def test_a_stopped_redis_registry_keeps_the_table_served(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    _register(store, "v1")
    _activate(store, "v1")
    versions = _following(store)
    assert await versions.look()
    redis_server.process.kill()
    redis_server.process.wait(timeout=10)
    for _ in range(3):
        assert not await versions.look()
    assert versions.route(MODEL, "").version == "v1"
    assert versions.health.state == "unreachable" and _state("unreachable") == 1
    store.close()


@pytest.mark.parametrize("change", ["rewritten", "deleted"])
async def test_a_version_whose_artifact_changed_since_it_was_registered_is_refused(
    tmp_path, caplog, change
):
    """Without workers of its own (served by the router's): its file is checked all the
    same, by size and sha256."""
    store = FileStore(tmp_path / "deployments.json")
    weights = {name: tmp_path / f"{name}.bin" for name in ("v1", "v2")}
    for name, path in weights.items():
        path.write_bytes(name.encode() * 1000)
        _register(store, name, path)
    _activate(store, "v1")
    versions = _following(store)
    assert await versions.look()
    if change == "rewritten":
        weights["v2"].write_bytes(b"other weights of the same size".ljust(2000, b"."))
    else:
        weights["v2"].unlink()
    _activate(store, "v2")
    for _ in range(3):
        assert await versions.look()  # the registry reads well; the version is refused
        assert versions.route(MODEL, "").version == "v1"
    refusals = [r for r in caplog.records if r.getMessage().startswith("registry change not")]
    assert len(refusals) == 1 and "v2.bin" in refusals[0].getMessage()


def _context(*metadata: tuple[str, str]) -> SimpleNamespace:
    return SimpleNamespace(invocation_metadata=lambda: metadata)


@pytest.mark.parametrize(
    ("metadata", "shown"),
    [
        ((), True),  # from inside the mesh: `aimesh models` against the router
        (((SCOPES_METADATA_KEY, "admin,read"),), True),  # the edge, an admin key
        (((SCOPES_METADATA_KEY, "generate,read"),), False),  # the edge, a read key
        (((SCOPES_METADATA_KEY, ""),), False),
    ],
)
async def test_artifact_paths_are_shown_to_operators_and_admin_keys_only(tmp_path, metadata, shown):
    assert SCOPES_METADATA_KEY == SCOPES_HEADER  # what the edge's authorizer sends
    store = FileStore(tmp_path / "deployments.json")
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 100)
    _register(store, "v1", weights)
    _activate(store, "v1")
    models = ModelServicer()
    models.versions = _following(store)
    assert await models.versions.look()
    listed = await models.ListModels(models_pb2.ListModelsRequest(), _context(*metadata))
    got = await models.GetModel(models_pb2.GetModelRequest(model=MODEL), _context(*metadata))
    for model in (next(m for m in listed.models if m.name == MODEL), got.model):
        (version,) = model.versions
        assert version.artifact_sha256 == Artifact.of(weights).sha256  # always
        assert version.artifact_path == (str(weights.resolve()) if shown else "")


async def test_a_registry_that_cannot_be_read_is_said_without_its_path_to_a_read_key(tmp_path):
    store = FileStore(tmp_path / "deployments.json")
    _register(store, "v1")
    models = ModelServicer()
    models.versions = _following(store)
    store.path.write_text("{")
    reader = _context((SCOPES_METADATA_KEY, "read"))
    for context, names_the_file in ((reader, False), (_context(), True)):
        with pytest.raises(RegistryInvalid) as refused:  # FAILED_PRECONDITION
            await models.ListModels(models_pb2.ListModelsRequest(), context)
        assert (str(store.path) in str(refused.value)) is names_the_file
