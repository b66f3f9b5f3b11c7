"""`aimesh models`: the model registry (mesh/deployments.py) from an operator's shell.

`list`, `activate`, `canary` and `rollback` go to the running mesh's ModelService (the
generation router, or the edge with an admin key): the router warms the target version
before the change routes a request to it. `--offline` changes the store the mesh config
names (`deployments`) directly instead, for a mesh that is down. `register` and `events`
always work on the store: registering hashes the artifact where the operator is."""

from __future__ import annotations

import datetime
import getpass
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from aimesh.llm.v1 import models_pb2, models_pb2_grpc
from mesh import deployments
from mesh.client import create_channel
from mesh.commands import run_command
from mesh.config import MeshSettings
from mesh.deployments import Artifact, Deployment, Event, RegistryState, Version
from mesh.failures import Failure
from services.generation import SPEC

# From the generated code, not the servicer: a command must not import the engine.
MODELS = models_pb2.DESCRIPTOR.services_by_name["ModelService"]

models_app = typer.Typer(help="Models as versioned deployments.", no_args_is_help=True)
console = Console()

Actor = Annotated[
    str | None,
    typer.Option(help="with --offline: who makes the change, for the audit trail; default: you"),
]
Offline = Annotated[
    bool,
    typer.Option(
        "--offline",
        help="change the store directly (the mesh down): nothing is warmed or checked live",
    ),
]
Edge = Annotated[
    str | None,
    typer.Option(help="HOST:PORT of the edge (Envoy), with --key; default: the router itself"),
]
Key = Annotated[
    str | None, typer.Option(envvar="AIMESH_API_KEY", help="the edge's API key (admin scope)")
]
EdgeCa = Annotated[
    Path | None,
    typer.Option(
        envvar="AIMESH_EDGE_CA",
        help="with --edge: the CA its listener's certificate is signed by (PEM), to reach it "
        "over TLS; without it the edge is dialled in plaintext (a loopback edge)",
    ),
]
Timeout = Annotated[
    float, typer.Option(help="seconds for the call: a change waits for the version to warm")
]


def _store() -> deployments.FileStore | deployments.RedisStore:
    settings = MeshSettings()
    return deployments.open_store(settings.deployments, settings.cache_dir)


def _registry() -> RegistryState:
    """The registry as its store holds it; exits 1 saying why when it cannot be read (a
    store down, a document that is not a registry)."""
    try:
        return _store().load()
    except Failure as failure:
        typer.echo(f"error: {failure}", err=True)
        raise typer.Exit(1) from None


def _change(change, actor: str | None) -> Event:
    """Applies one change and prints its event; a refused change exits 1 with the reason."""
    who = actor or getpass.getuser()
    try:
        event = _store().update(lambda state: change(state, who))
    except (Failure, ValidationError) as failure:
        typer.echo(f"error: {failure}", err=True)
        raise typer.Exit(1) from None
    console.print(
        f"#{event.seq} {event.actor}: {event.action} {event.model}: "
        f"{event.before or '-'} -> {event.after or '-'}"
    )
    return event


def _pairs(items: list[str], option: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{option} takes KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _typed(value: str) -> str | int | float | bool:
    """A capability as what it says: true/false, a number, or text."""
    if value in ("true", "false"):
        return value == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@models_app.command("list")
def list_models(
    offline: Offline = False,
    edge: Edge = None,
    edge_ca: EdgeCa = None,
    key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """Every model: its versions, the active one and the canary."""
    table = Table("model", "active", "canary", "versions", "previous")
    if offline:
        for name, deployment in sorted(_registry().deployments.items()):
            canary = deployment.canary
            table.add_row(
                name,
                deployment.active or "-",
                f"{canary.version} {canary.percent}%" if canary else "-",
                ", ".join(deployment.versions),
                ", ".join(deployment.previous[-3:]) or "-",
            )
    else:
        listed = _call(
            lambda stub, metadata: stub.ListModels(
                models_pb2.ListModelsRequest(), metadata=metadata
            ),
            edge,
            key,
            timeout,
            edge_ca,
        )
        for model in listed.models:
            serving = {v.name for v in model.versions if v.state == "serving"}
            table.add_row(
                model.name,
                model.active or "-",
                f"{model.canary.version} {model.canary.percent}%"
                if model.HasField("canary")
                else "-",
                ", ".join(v.name + ("*" if v.name in serving else "") for v in model.versions),
                ", ".join(model.previous[-3:]) or "-",
            )
        table.caption = "* serving on the router that answered"
    console.print(table)


def _call(
    call: Callable[[models_pb2_grpc.ModelServiceStub, Any], Awaitable[Any]],
    edge: str | None,
    key: str | None,
    timeout: float,
    edge_ca: Path | None = None,
) -> Any:
    """One ModelService call to the running mesh: the router, or the edge with a key
    (over TLS when its CA is given: a key crosses no network in clear text)."""

    trusted = (
        None
        if edge_ca is None
        else grpc.ssl_channel_credentials(root_certificates=edge_ca.read_bytes())
    )

    async def work() -> Any:
        settings = MeshSettings()
        if edge is None:
            channel = create_channel(
                settings.target_of(SPEC.name, SPEC.default_port), settings, services=[MODELS]
            )
            metadata: tuple[tuple[str, str], ...] = ()
        else:
            if not key:
                typer.echo("error: --edge needs --key (or AIMESH_API_KEY)", err=True)
                raise typer.Exit(1)
            if trusted is None:
                channel = grpc.aio.insecure_channel(edge)
            else:
                channel = grpc.aio.secure_channel(edge, trusted)
            metadata = (("authorization", f"Bearer {key}"),)
        async with channel:
            return await call(models_pb2_grpc.ModelServiceStub(channel), metadata)

    result, _ = run_command("models", work, timeout_s=timeout)
    return result


def _said(event: models_pb2.ModelEvent) -> None:
    console.print(
        f"#{event.seq} {event.actor}: {event.action} {event.model}: "
        f"{event.before or '-'} -> {event.after or '-'} (routed in {event.applied_s:.2f} s)"
    )


@models_app.command()
def register(
    model: str,
    version: str,
    artifact: Annotated[
        Path | None,
        typer.Option(exists=True, help="the weights file, or a model directory with a manifest"),
    ] = None,
    engine: Annotated[str, typer.Option(help="the engine that runs it")] = "",
    capability: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE, e.g. context_length=2048")
    ] = None,
    workers: Annotated[
        list[str] | None, typer.Option(help="KIND=TARGET[,TARGET], e.g. decode=127.0.0.1:50063")
    ] = None,
    actor: Actor = None,
) -> None:
    """Adds a version: its artifact's size and sha256 are recorded now and checked
    before the version is activated."""
    try:
        spec = Version(
            name=version,
            artifact=None if artifact is None else Artifact.of(artifact),
            engine=engine,
            capabilities={
                k: _typed(v) for k, v in _pairs(capability or [], "--capability").items()
            },
            workers={k: v.split(",") for k, v in _pairs(workers or [], "--workers").items()},
        )
    except (ValidationError, Failure) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    _change(lambda state, who: deployments.register(state, model, spec, who), actor)


def _check_artifact(model: str, target: Callable[[Deployment], str | None], undone: str) -> None:
    """Exits 1 unless the version `target` names has an artifact that still matches (or
    none). Checked before the change takes the store's lock, as hashing weights takes a
    while: a file swapped in between is not caught here."""
    try:
        deployment = _store().load().deployment(model)
        version = target(deployment)
        held = None if version is None else deployment.versions.get(version)
        if held is not None and held.artifact is not None:
            held.artifact.verify()
    except Failure as failure:
        typer.echo(f"error: not {undone}: {failure}", err=True)
        raise typer.Exit(1) from None


@models_app.command()
def activate(
    model: str,
    version: str,
    reason: Annotated[str, typer.Option(help="said in the audit trail")] = "",
    offline: Offline = False,
    edge: Edge = None,
    edge_ca: EdgeCa = None,
    key: Key = None,
    timeout: Timeout = 180.0,
    actor: Actor = None,
) -> None:
    """Makes VERSION the one every user gets, once its workers serve its artifact warm."""
    if offline:
        _check_artifact(model, lambda deployment: version, "activated")
        _change(lambda state, who: deployments.activate(state, model, version, who, reason), actor)
        return
    request = models_pb2.ActivateRequest(model=model, version=version, reason=reason)
    _said(
        _call(
            lambda stub, md: stub.Activate(request, metadata=md), edge, key, timeout, edge_ca
        ).event
    )


@models_app.command()
def canary(
    model: str,
    version: str,
    percent: int,
    reason: Annotated[str, typer.Option(help="said in the audit trail")] = "",
    offline: Offline = False,
    edge: Edge = None,
    edge_ca: EdgeCa = None,
    key: Key = None,
    timeout: Timeout = 180.0,
    actor: Actor = None,
) -> None:
    """Sends PERCENT of users (by a hash of their user id) to VERSION; 0 ends it."""
    if offline:
        _change(
            lambda state, who: deployments.set_canary(state, model, version, percent, who, reason),
            actor,
        )
        return
    request = models_pb2.SetCanaryRequest(
        model=model, version=version, percent=percent, reason=reason
    )
    _said(
        _call(
            lambda stub, md: stub.SetCanary(request, metadata=md), edge, key, timeout, edge_ca
        ).event
    )


@models_app.command()
def rollback(
    model: str,
    reason: Annotated[str, typer.Option(help="said in the audit trail")] = "",
    offline: Offline = False,
    edge: Edge = None,
    edge_ca: EdgeCa = None,
    key: Key = None,
    timeout: Timeout = 180.0,
    actor: Actor = None,
) -> None:
    """Ends the canary, or without one returns to the version active before (once its
    artifact checks out)."""
    if offline:
        _check_artifact(
            model,
            lambda d: None if d.canary is not None or not d.previous else d.previous[-1],
            "rolled back",
        )
        _change(lambda state, who: deployments.rollback(state, model, who, reason), actor)
        return
    request = models_pb2.RollbackRequest(model=model, reason=reason)
    _said(
        _call(
            lambda stub, md: stub.Rollback(request, metadata=md), edge, key, timeout, edge_ca
        ).event
    )


@models_app.command()
def events(
    model: Annotated[str | None, typer.Option(help="only this model's")] = None,
    last: Annotated[int, typer.Option(min=1, help="how many")] = 20,
) -> None:
    """The audit trail: who changed what, when, from what to what."""
    state = _registry()
    table = Table("#", "at (UTC)", "actor", "model", "action", "from", "to", "reason")
    chosen = [e for e in state.events if model is None or e.model == model][-last:]
    for event in chosen:
        table.add_row(
            str(event.seq),
            _utc(event.at),
            event.actor,
            event.model,
            event.action,
            event.before or "-",
            event.after or "-",
            event.reason,
        )
    console.print(table)


def _utc(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
