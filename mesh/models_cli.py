"""`aimesh models`: the model registry (mesh/deployments.py) from an operator's shell.
Each command is one audited change of the store the mesh config names (`deployments`),
made under the store's lock, and says what moved."""

from __future__ import annotations

import datetime
import getpass
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from mesh import deployments
from mesh.config import MeshSettings
from mesh.deployments import Artifact, Deployment, Event, RegistryState, Version
from mesh.failures import Failure

models_app = typer.Typer(help="Models as versioned deployments.", no_args_is_help=True)
console = Console()

Actor = Annotated[
    str | None, typer.Option(help="who makes the change, for the audit trail; default: you")
]


def _store() -> deployments.FileStore | deployments.RedisStore:
    settings = MeshSettings()
    return deployments.open_store(settings.deployments, settings.cache_dir)


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
def list_models() -> None:
    """Every model: its versions, the active one and the canary."""
    state = _store().load()
    table = Table("model", "active", "canary", "versions", "previous")
    for name, deployment in sorted(state.deployments.items()):
        canary = deployment.canary
        table.add_row(
            name,
            deployment.active or "-",
            f"{canary.version} {canary.percent}%" if canary else "-",
            ", ".join(deployment.versions),
            ", ".join(deployment.previous[-3:]) or "-",
        )
    console.print(table)


@models_app.command()
def register(
    model: str,
    version: str,
    artifact: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="the weights file")
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
    except ValidationError as error:
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
def activate(model: str, version: str, actor: Actor = None) -> None:
    """Makes VERSION the one every user gets, once its artifact checks out."""
    _check_artifact(model, lambda deployment: version, "activated")
    _change(lambda state, who: deployments.activate(state, model, version, who), actor)


@models_app.command()
def canary(model: str, version: str, percent: int, actor: Actor = None) -> None:
    """Sends PERCENT of users (by a hash of their user id) to VERSION; 0 ends it."""
    _change(lambda state, who: deployments.set_canary(state, model, version, percent, who), actor)


@models_app.command()
def rollback(
    model: str,
    reason: Annotated[str, typer.Option(help="said in the audit trail")] = "",
    actor: Actor = None,
) -> None:
    """Ends the canary, or without one returns to the version active before (once its
    artifact checks out)."""
    _check_artifact(
        model,
        lambda d: None if d.canary is not None or not d.previous else d.previous[-1],
        "rolled back",
    )
    _change(lambda state, who: deployments.rollback(state, model, who, reason), actor)


@models_app.command()
def events(
    model: Annotated[str | None, typer.Option(help="only this model's")] = None,
    last: Annotated[int, typer.Option(min=1, help="how many")] = 20,
) -> None:
    """The audit trail: who changed what, when, from what to what."""
    state: RegistryState = _store().load()
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
