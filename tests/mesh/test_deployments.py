"""The model registry (mesh/deployments.py): canary by user within a point of its share
and the same on every replica, activate and rollback with an audit trail, immutable
versions, artifacts checked before they serve, no change lost between concurrent writers,
in a file and in a real Redis; and `aimesh models` driving it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mesh import deployments
from mesh.artifacts import artifact_digest, write_manifest
from mesh.cli import app
from mesh.deployments import (
    Artifact,
    FileStore,
    RedisStore,
    RegistryInvalid,
    RegistryState,
    RegistryUnreachable,
    Version,
    activate,
    end_canary,
    register,
    rollback,
    set_canary,
)
from mesh.failures import AlreadyExists, Conflict, InvalidInput, NotFound
from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.unit

USERS = [f"user-{uuid.UUID(int=n)}" for n in range(10_000)]


def two_versions(store) -> None:
    store.update(lambda s: register(s, "smollm2", Version(name="torch", engine="torch"), "ops"))
    store.update(lambda s: register(s, "smollm2", Version(name="gguf", engine="llama.cpp"), "ops"))
    store.update(lambda s: activate(s, "smollm2", "torch", "ops"))


@pytest.mark.parametrize("percent", [1, 10, 37, 50])
def test_the_canary_gets_its_share_of_users_within_a_point(percent):
    state = RegistryState()
    register(state, "m", Version(name="a"), "ops")
    register(state, "m", Version(name="b"), "ops")
    activate(state, "m", "a", "ops")
    set_canary(state, "m", "b", percent, "ops")
    chosen = [state.deployment("m").version_for(user) for user in USERS]
    share = 100 * chosen.count("b") / len(USERS)
    assert abs(share - percent) <= 1, share
    assert state.deployment("m").version_for(None) == "a"  # no user id: the stable one
    assert state.deployment("m").version_for("") == "a"


def test_two_replicas_on_one_store_send_every_user_to_the_same_version(tmp_path):
    """Stickiness across replicas: two stores (as two routers) read the same file."""
    first, second = FileStore(tmp_path / "r.json"), FileStore(tmp_path / "r.json")
    two_versions(first)
    first.update(lambda s: set_canary(s, "smollm2", "gguf", 20, "ops"))
    one, other = first.load().deployment("smollm2"), second.load().deployment("smollm2")
    assert [one.version_for(u) for u in USERS] == [other.version_for(u) for u in USERS]
    assert deployments.bucket("alice") == deployments.bucket("alice")  # not Python's hash()


def test_activate_canary_and_rollback_are_audited_and_survive_a_restart(tmp_path):
    store = FileStore(tmp_path / "registry.json")
    two_versions(store)
    store.update(lambda s: set_canary(s, "smollm2", "gguf", 10, "alice"))
    store.update(lambda s: rollback(s, "smollm2", "auto", "canary error rate 3x stable"))
    assert store.load().deployment("smollm2").canary is None
    store.update(lambda s: activate(s, "smollm2", "gguf", "alice"))
    event = store.update(lambda s: rollback(s, "smollm2", "bob", "p99 TTFT"))
    assert (event.before, event.after, event.actor) == ("gguf", "torch", "bob")
    restarted = FileStore(tmp_path / "registry.json").load()
    assert restarted.deployment("smollm2").active == "torch"
    actions = [(e.action, e.before, e.after, e.actor) for e in restarted.events]
    assert actions[-4:] == [
        ("canary", None, "gguf@10%", "alice"),
        ("rollback", "gguf@10%", None, "auto"),
        ("activate", "torch", "gguf", "alice"),
        ("rollback", "gguf", "torch", "bob"),
    ]
    assert [e.seq for e in restarted.events] == list(range(1, len(restarted.events) + 1))
    assert restarted.revision == len(restarted.events)
    with pytest.raises(Conflict):  # nothing earlier than torch
        store.update(lambda s: rollback(s, "smollm2", "bob"))


def test_bad_changes_are_refused_and_change_nothing(tmp_path):
    store = FileStore(tmp_path / "registry.json")
    two_versions(store)
    before = store.load()
    with pytest.raises(NotFound):
        store.update(lambda s: activate(s, "smollm2", "nope", "ops"))
    with pytest.raises(NotFound):
        store.update(lambda s: activate(s, "other-model", "torch", "ops"))
    with pytest.raises(InvalidInput):
        store.update(lambda s: set_canary(s, "smollm2", "gguf", 101, "ops"))
    with pytest.raises(InvalidInput):
        store.update(lambda s: set_canary(s, "smollm2", "torch", 5, "ops"))  # the active one
    changed = Version(name="torch", engine="llama.cpp")
    with pytest.raises(AlreadyExists):  # versions are immutable
        store.update(lambda s: register(s, "smollm2", changed, "ops"))
    assert store.load() == before
    with pytest.raises(ValueError):
        Version(name="../../etc")


def test_a_changed_or_truncated_artifact_is_refused(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"w" * 4096)
    artifact = Artifact.of(weights)
    artifact.verify()
    weights.write_bytes(b"w" * 4095 + b"x")  # same size, other bytes
    with pytest.raises(Conflict, match="sha256"):
        artifact.verify()
    weights.write_bytes(b"w" * 100)
    with pytest.raises(Conflict, match="bytes"):
        artifact.verify()
    weights.unlink()
    with pytest.raises(Conflict):
        artifact.verify()


def _canary_flips(path: str, times: int) -> None:
    store = FileStore(Path(path))
    for n in range(times):
        store.update(lambda s, n=n: set_canary(s, "smollm2", "gguf", n % 50 + 1, "writer"))


@pytest.mark.service  # two writer processes
def test_concurrent_writers_lose_no_change(tmp_path):
    path = tmp_path / "registry.json"
    two_versions(FileStore(path))
    # Plain interpreters rather than multiprocessing, whose resource tracker would
    # outlive the test.
    code = (
        f"from tests.mesh.test_deployments import _canary_flips; _canary_flips({str(path)!r}, 40)"
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(), cwd=ROOT)
        for _ in range(2)
    ]
    for writer in writers:
        assert writer.wait(timeout=120) == 0
    state = FileStore(path).load()
    assert state.revision == 3 + 80
    assert [e.seq for e in state.events] == list(range(1, 84))


@pytest.mark.service  # a real redis-server
def test_in_redis_replicas_share_one_registry_and_lose_no_change(redis_url):
    first, second = RedisStore(redis_url), RedisStore(redis_url)
    try:
        two_versions(first)
        second.update(lambda s: set_canary(s, "smollm2", "gguf", 30, "ops"))
        one, other = first.load().deployment("smollm2"), second.load().deployment("smollm2")
        assert [one.version_for(u) for u in USERS] == [other.version_for(u) for u in USERS]
        assert one.canary.percent == 30

        def flip_twice(state: RegistryState):
            # Another replica writes between this one's read and its write: the
            # transaction is retried on the newer state, and both changes stay.
            if not hasattr(flip_twice, "raced"):
                flip_twice.raced = True
                second.update(lambda s: set_canary(s, "smollm2", "gguf", 5, "other"))
            return set_canary(state, "smollm2", "gguf", 7, "this")

        first.update(flip_twice)
        state = first.load()
        assert [e.after for e in state.events[-2:]] == ["gguf@5%", "gguf@7%"]
        assert state.revision == len(state.events)
    finally:
        first.close()
        second.close()


def test_the_cli_offline_registers_activates_canaries_and_rolls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("AIMESH_DEPLOYMENTS", str(tmp_path / "registry.json"))
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"v2 weights")
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, ["models", *args])
        assert result.exit_code == 0, result.output
        return result.output

    run("register", "smollm2", "v1", "--engine", "torch", "--capability", "context_length=2048")
    run("register", "smollm2", "v2", "--artifact", str(weights), "--engine", "llama.cpp")
    assert "activate smollm2: - -> v1" in run(
        "activate", "smollm2", "v1", "--offline", "--actor", "ci"
    )
    run("canary", "smollm2", "v2", "10", "--offline")
    assert "v2 10%" in run("list", "--offline")
    weights.write_bytes(b"v2 weightz")  # corrupted after registration
    refused = runner.invoke(app, ["models", "activate", "smollm2", "v2", "--offline"])
    assert refused.exit_code == 1 and "sha256" in refused.output
    assert "rollback smollm2: v2@10% -> -" in run(
        "rollback", "smollm2", "--reason", "errors", "--offline"
    )
    state = FileStore(tmp_path / "registry.json").load()
    assert state.deployment("smollm2").active == "v1"
    assert state.deployment("smollm2").versions["v1"].capabilities == {"context_length": 2048}
    assert "errors" in run("events", "--model", "smollm2")
    unknown = runner.invoke(app, ["models", "canary", "nope", "v2", "10", "--offline"])
    assert unknown.exit_code == 1 and "no model" in unknown.output
    bad_name = runner.invoke(app, ["models", "register", "smollm2", "../v3"])
    assert bad_name.exit_code == 1 and "error" in bad_name.output
    assert isinstance(bad_name.exception, SystemExit)  # said, not a traceback
    # A rollback to a version whose weights changed since is refused too.
    weights.write_bytes(b"v2 weights")
    run("activate", "smollm2", "v2", "--offline")
    v3 = tmp_path / "v3.bin"
    v3.write_bytes(b"v3")
    run("register", "smollm2", "v3", "--artifact", str(v3))
    run("activate", "smollm2", "v3", "--offline")
    weights.write_bytes(b"v2 changed")
    back = runner.invoke(app, ["models", "rollback", "smollm2", "--offline"])
    assert back.exit_code == 1 and "not rolled back" in back.output
    assert FileStore(tmp_path / "registry.json").load().deployment("smollm2").active == "v3"


def test_a_model_directory_is_an_artifact_by_its_manifest(tmp_path):
    """A directory's digest is the one its workers report in GetInfo (the manifest's),
    and a file changed after registration is refused, as a weights file is."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"w" * 100)
    write_manifest(model, "test")
    artifact = Artifact.of(model)
    assert artifact.sha256 == artifact_digest(model)
    assert artifact.size == sum(p.stat().st_size for p in model.iterdir())
    artifact.verify()
    (model / "weights.bin").write_bytes(b"x" * 100)
    with pytest.raises(Conflict, match="sha256"):
        artifact.verify()
    with pytest.raises(Conflict, match="manifest"):
        Artifact.of(tmp_path)  # a directory without a manifest is no artifact


def test_ending_a_canary_by_rule_ends_only_the_canary_it_judged():
    """The automatic rule acts on a look that may be old: it must not roll back the
    active version, nor a newer canary, when its canary is already gone."""
    state = RegistryState()
    for name in ("a", "b", "c"):
        register(state, "m", Version(name=name), "ops")
    activate(state, "m", "a", "ops")
    set_canary(state, "m", "b", 10, "ops")
    event = end_canary(state, "m", "b", "rule", "errors 0.5")
    assert (event.before, event.after, event.reason) == ("b@10%", None, "errors 0.5")
    with pytest.raises(Conflict):
        end_canary(state, "m", "b", "rule", "again")
    set_canary(state, "m", "c", 10, "ops")
    with pytest.raises(Conflict):
        end_canary(state, "m", "b", "rule", "old look")
    deployment = state.deployment("m")
    assert deployment.active == "a" and deployment.canary.version == "c"


def _hand_edited(path: Path, edit) -> bytes:
    """The registry file as `edit` leaves its JSON text; returns what it then holds."""
    path.write_text(edit(path.read_text()))
    return path.read_bytes()


@pytest.mark.parametrize(
    "edit",
    [
        # A field this version does not know (a newer writer's, a typo).
        lambda text: text.replace('"revision"', '"colour": "red", "revision"', 1),
        # Cut short: a copy that stopped half way.
        lambda text: text[: len(text) // 2],
        # Names a version it does not hold.
        lambda text: text.replace('"active": "torch"', '"active": "gone"'),
        lambda text: "",
    ],
    ids=["unknown-field", "cut-short", "unknown-version", "empty"],
)
def test_a_file_that_is_no_registry_is_refused_and_never_written_over(tmp_path, edit):
    store = FileStore(tmp_path / "deployments.json")
    two_versions(store)
    held = _hand_edited(store.path, edit)
    with pytest.raises(RegistryInvalid) as refused:
        store.load()
    assert str(store.path) in str(refused.value)
    assert isinstance(refused.value, Conflict)  # FAILED_PRECONDITION, not INTERNAL
    with pytest.raises(RegistryInvalid):
        store.update(lambda s: activate(s, "smollm2", "gguf", "ops"))
    assert store.path.read_bytes() == held


def test_an_unreadable_registry_file_is_unreachable_not_invalid(tmp_path):
    store = FileStore(tmp_path / "deployments.json")
    store.path.mkdir()  # reading a directory fails with an OSError, as an I/O error would
    with pytest.raises(RegistryUnreachable):
        store.load()


@pytest.mark.service  # a real redis-server, stopped
def test_a_redis_registry_that_does_not_answer_is_unreachable(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    two_versions(store)
    redis_server.process.kill()
    redis_server.process.wait(timeout=10)
    with pytest.raises(RegistryUnreachable):
        store.load()
    with pytest.raises(RegistryUnreachable):
        store.update(lambda s: activate(s, "smollm2", "gguf", "ops"))
    store.close()


@pytest.mark.service  # a real redis-server
def test_a_redis_registry_holding_no_registry_is_invalid(redis_url):
    store = RedisStore(redis_url)
    store.client.set(RedisStore.KEY, b'{"revision": 3, "deployments": {}, "extra": 1}')
    with pytest.raises(RegistryInvalid):
        store.load()
    store.close()
