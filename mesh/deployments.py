"""Models as versioned deployments: which version of each model is active, which one is
the canary and for what share of users, and every change to that, audited.

The registry is the one source of truth for those decisions; the processes that serve
models read it, and operators change it (`aimesh models ...`). Its state is one small
document, kept in a file (the embedded default, one machine) or in Redis (several router
replicas share it). Every change is a read-modify-write under the store's own guard (an
flock on the file; WATCH/MULTI in Redis), so two operators never lose each other's
change, and appends an Event (who, when, what, from what to what) to the audit trail.

Canary by user, as seed 003 §5.8 asks: a user id lands in bucket
`sha256(user id) mod 100`, and buckets below the canary's percent get the canary. The
bucket depends on the user id alone, so a user stays on one version across requests and
across replicas; no user id means the active (stable) version.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from mesh.artifacts import artifact_digest, locked, manifest_problems, sha256_of
from mesh.failures import (
    AlreadyExists,
    Conflict,
    FieldViolation,
    InvalidInput,
    NotFound,
    NotReady,
)

BUCKETS = 100
# The audit trail the state document keeps (oldest dropped first); a change log, not a
# history of every request.
MAX_EVENTS = 1000
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def bucket(user_id: str) -> int:
    """The user's canary bucket, 0..99: the same for the same id in every process."""
    digest = hashlib.sha256(user_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


class Artifact(BaseModel, extra="forbid"):
    """A version's weights: where they are and what they must be before anything loads
    them (a truncated download or a swapped file is refused, not served)."""

    path: Path
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @classmethod
    def of(cls, path: Path) -> Artifact:
        """The artifact `path` is now: a file's size and sha256, or a checked model
        directory's total size and manifest digest (what its workers report in GetInfo).
        Reads every file: off the event loop."""
        path = path.resolve()
        if path.is_dir():
            problems = manifest_problems(path)
            if problems:
                raise Conflict(f"artifact {path}: {'; '.join(problems)}")
            return cls(path=path, size=_directory_size(path), sha256=artifact_digest(path))
        return cls(path=path, size=path.stat().st_size, sha256=sha256_of(path))

    def verify(self) -> None:
        """Raises Conflict unless the artifact has the declared size and digest (a
        directory: and every file matches its manifest). Reads every file: call it off the
        event loop."""
        try:
            now = Artifact.of(self.path)
        except OSError as error:
            raise Conflict(f"artifact {self.path}: {error.strerror}") from None
        if now.size != self.size:
            raise Conflict(
                f"artifact {self.path} is {now.size} bytes, the version declares {self.size}"
            )
        if now.sha256 != self.sha256:
            raise Conflict(f"artifact {self.path} does not match its sha256")


def _directory_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


class Version(BaseModel, extra="forbid"):
    """One deployable version of a model: its artifact, the engine that runs it, what it
    can do (context length, chat template, guided choice, dtype, ...) and the workers that
    serve it (by kind: e.g. prefill and decode targets)."""

    name: str = Field(pattern=NAME_PATTERN)
    artifact: Artifact | None = None
    engine: str = ""
    capabilities: dict[str, str | int | float | bool] = Field(default_factory=dict)
    workers: dict[str, list[str]] = Field(default_factory=dict)


class Canary(BaseModel, extra="forbid"):
    version: str
    percent: int = Field(ge=0, le=100)


class Deployment(BaseModel, extra="forbid"):
    """A model's versions, the active one, the versions that were active before it (most
    recent last: where a rollback returns to) and its canary, if any."""

    model: str = Field(pattern=NAME_PATTERN)
    versions: dict[str, Version] = Field(default_factory=dict)
    active: str | None = None
    previous: list[str] = Field(default_factory=list)
    canary: Canary | None = None

    @model_validator(mode="after")
    def _names_known_versions(self) -> Deployment:
        """A document edited by hand must not name a version it does not hold: the
        router would route to nothing."""
        for key, version in self.versions.items():
            if key != version.name:
                raise ValueError(f"versions[{key!r}] is named {version.name!r}")
        named = [self.active, *self.previous, self.canary.version if self.canary else None]
        unknown = sorted({name for name in named if name and name not in self.versions})
        if unknown:
            raise ValueError(f"names versions it does not hold: {unknown}")
        return self

    def version_for(self, user_id: str | None) -> str:
        """The version a request of `user_id` runs on."""
        if self.active is None:
            raise Conflict(f"model {self.model!r} has no active version")
        canary = self.canary
        if canary is not None and user_id and bucket(user_id) < canary.percent:
            return canary.version
        return self.active


class Event(BaseModel, extra="forbid"):
    """One audited change: who made it, when, and what moved from what to what."""

    seq: int
    at: float  # Unix time
    actor: str
    model: str
    action: str  # register, activate, canary, rollback
    before: str | None = None
    after: str | None = None
    reason: str = ""


class RegistryState(BaseModel, extra="forbid"):
    revision: int = 0
    deployments: dict[str, Deployment] = Field(default_factory=dict)
    events: list[Event] = Field(default_factory=list)

    @field_validator("events")
    @classmethod
    def _bounded(cls, events: list[Event]) -> list[Event]:
        return events[-MAX_EVENTS:]

    @model_validator(mode="after")
    def _keyed_by_model(self) -> RegistryState:
        for key, deployment in self.deployments.items():
            if key != deployment.model:
                raise ValueError(f"deployments[{key!r}] is model {deployment.model!r}")
        return self

    def deployment(self, model: str) -> Deployment:
        found = self.deployments.get(model)
        if found is None:
            raise NotFound(f"no model {model!r}", resource_type="model", resource_name=model)
        return found

    def record(self, actor: str, model: str, action: str, **change: Any) -> Event:
        event = Event(
            seq=(self.events[-1].seq + 1) if self.events else 1,
            at=time.time(),
            actor=actor,
            model=model,
            action=action,
            **change,
        )
        self.events = [*self.events, event][-MAX_EVENTS:]
        return event


def known_version(deployment: Deployment, version: str) -> None:
    if version not in deployment.versions:
        raise NotFound(
            f"model {deployment.model!r} has no version {version!r}",
            resource_type="model_version",
            resource_name=f"{deployment.model}/{version}",
        )


def _invalid(field: str, description: str) -> InvalidInput:
    return InvalidInput([FieldViolation(field, description)])


def register(state: RegistryState, model: str, version: Version, actor: str) -> Event:
    """Adds `version` to `model` (made if new). Versions are immutable: registering a
    name again with anything different is refused."""
    deployment = state.deployments.setdefault(model, Deployment(model=model))
    held = deployment.versions.get(version.name)
    if held is not None and held != version:
        raise AlreadyExists(
            f"model {model!r} already has a different version {version.name!r}; "
            "versions are immutable, register a new name"
        )
    deployment.versions[version.name] = version
    return state.record(actor, model, "register", after=version.name)


def activate(state: RegistryState, model: str, version: str, actor: str, reason: str = "") -> Event:
    """Makes `version` the active one; a canary of that version becomes the whole."""
    deployment = state.deployment(model)
    known_version(deployment, version)
    before = deployment.active
    if before is not None and before != version:
        deployment.previous = [*deployment.previous, before][-MAX_EVENTS:]
    deployment.active = version
    if deployment.canary is not None and deployment.canary.version == version:
        deployment.canary = None
    return state.record(actor, model, "activate", before=before, after=version, reason=reason)


def set_canary(
    state: RegistryState, model: str, version: str, percent: int, actor: str, reason: str = ""
) -> Event:
    """Sends `percent` of users (by bucket) to `version`; 0 ends the canary."""
    deployment = state.deployment(model)
    known_version(deployment, version)
    if not 0 <= percent <= 100:
        raise _invalid("percent", f"must be 0..100, got {percent}")
    if version == deployment.active:
        raise _invalid("version", f"{version!r} is already the active version")
    before = deployment.canary
    deployment.canary = Canary(version=version, percent=percent) if percent else None
    return state.record(
        actor,
        model,
        "canary",
        before=None if before is None else f"{before.version}@{before.percent}%",
        after=f"{version}@{percent}%",
        reason=reason,
    )


def rollback(state: RegistryState, model: str, actor: str, reason: str = "") -> Event:
    """Ends the canary if there is one; else returns to the version active before."""
    deployment = state.deployment(model)
    if deployment.canary is not None:
        before = f"{deployment.canary.version}@{deployment.canary.percent}%"
        deployment.canary = None
        return state.record(actor, model, "rollback", before=before, after=None, reason=reason)
    if not deployment.previous:
        raise Conflict(f"model {model!r} has no earlier version to roll back to")
    *earlier, last_good = deployment.previous
    before, deployment.active, deployment.previous = deployment.active, last_good, earlier
    return state.record(actor, model, "rollback", before=before, after=last_good, reason=reason)


def end_canary(state: RegistryState, model: str, version: str, actor: str, reason: str) -> Event:
    """Ends the canary of `version` only: what an automatic rule calls, so that a rule
    acting on an old look at the registry never rolls back anything else."""
    deployment = state.deployment(model)
    canary = deployment.canary
    if canary is None or canary.version != version:
        raise Conflict(f"model {model!r} has no canary of version {version!r} any more")
    return rollback(state, model, actor, reason)


class RegistryUnreachable(NotReady):
    """The store did not answer (Redis down, the file unreadable): UNAVAILABLE, try again."""

    reason = "REGISTRY_UNREACHABLE"


class RegistryInvalid(Conflict):
    """The store answered with a document that is not a registry (a field this version
    does not know, a file cut short): FAILED_PRECONDITION until someone fixes it. Nothing
    is written over it: a change made on top of it would lose what it held."""

    reason = "REGISTRY_INVALID"


# How much of a validation error a refusal and a log line quote.
_PROBLEMS_QUOTED = 3


def parsed(raw: bytes | None, where: str) -> RegistryState:
    """The registry document `raw` (None: there is none yet, an empty registry);
    RegistryInvalid naming the first problems when it is not one."""
    if raw is None:
        return RegistryState()
    try:
        return RegistryState.model_validate_json(raw)
    except ValidationError as error:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or 'document'}: {e['msg']}"
            for e in error.errors()[:_PROBLEMS_QUOTED]
        ]
        raise RegistryInvalid(
            f"registry {where} is not a valid registry document "
            f"({error.error_count()} problem(s): {'; '.join(problems)})"
        ) from None


class Store(Protocol):
    def load(self) -> RegistryState:
        """The registry now; RegistryUnreachable or RegistryInvalid when it cannot be had."""
        ...

    def update(self, change: Callable[[RegistryState], Event]) -> Event:
        """Applies `change` to the newest state and saves it, atomically with respect to
        every other update; what `change` raises leaves the state as it was."""
        ...


class FileStore:
    """The state as a JSON file (written whole, then renamed over the old one), guarded
    by an flock on a lock file beside it: one machine's processes share it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")

    def load(self) -> RegistryState:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return RegistryState()
        except OSError as error:
            raise RegistryUnreachable(f"registry {self.path}: {error.strerror}") from None
        return parsed(raw, str(self.path))

    def update(self, change: Callable[[RegistryState], Event]) -> Event:
        with locked(self.lock_path):
            state = self.load()
            event = change(state)
            state.revision += 1
            partial = self.path.with_name(f".{self.path.name}.partial")
            with partial.open("w") as file:
                file.write(state.model_dump_json(indent=1))
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, self.path)
            return event


class RedisStore:
    """The state as one JSON value in Redis, changed by optimistic transactions (WATCH,
    then MULTI/EXEC, again if another writer got there first): router replicas on several
    machines share it."""

    KEY = "aimesh:deployments:state"

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        import redis  # only a registry configured for Redis needs the client

        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        address = self.client.connection_pool.connection_kwargs
        self.where = f"redis {address.get('host', '')}:{address.get('port', '')} {self.KEY}"

    def load(self) -> RegistryState:
        import redis

        try:
            raw = self.client.get(self.KEY)
        except redis.RedisError as error:
            raise RegistryUnreachable(f"registry {self.where}: {error}") from None
        return parsed(raw, self.where)

    def update(self, change: Callable[[RegistryState], Event]) -> Event:
        import redis

        while True:
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(self.KEY)
                    state = parsed(pipe.get(self.KEY), self.where)
                    event = change(state)
                    state.revision += 1
                    pipe.multi()
                    pipe.set(self.KEY, state.model_dump_json())
                    pipe.execute()
                    return event
                except redis.WatchError:
                    continue
                except redis.RedisError as error:
                    raise RegistryUnreachable(f"registry {self.where}: {error}") from None

    def close(self) -> None:
        self.client.close()


def open_store(setting: str, cache_dir: Path) -> FileStore | RedisStore:
    """`file` (<cache_dir>/deployments.json), a file path, or a redis:// URL."""
    if setting.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(setting)
    if setting == "file":
        return FileStore(cache_dir / "deployments.json")
    return FileStore(Path(setting))
