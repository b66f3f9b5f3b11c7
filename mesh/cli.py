"""The `aimesh` command: serve one service, bring the whole mesh up, check its health."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer
from pydantic import SecretStr
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aimesh.mesh.v1.info_pb2 import GetInfoResponse
from mesh import logs, supervisor, tracing
from mesh.authz import EDGE, OPERATOR
from mesh.config import MeshSettings
from mesh.edge import envoy
from mesh.edge import process as edge_process
from mesh.edge.authorizer import AuthorizerServer
from mesh.health import probe
from mesh.info import get_info, summary
from mesh.metrics import serve_metrics
from mesh.pki import ThrowawayCa
from mesh.registry import ServiceSpec, discover, options_problems, preflight_problems
from mesh.server import MeshServer
from mesh.tls import terminates_here, tls_environment

app = typer.Typer(help="aimesh: a gRPC mesh for AI serving.", no_args_is_help=True)
edge_app = typer.Typer(help="The Envoy edge in front of the mesh.", no_args_is_help=True)
app.add_typer(edge_app, name="edge")
console = Console()
log = logging.getLogger("aimesh")
# `up --tls --edge`: the listener's certificate and key in --tls-dir, as NAME.pem, NAME.key.
EDGE_LISTENER = "edge-listener"


def _spec(name: str) -> ServiceSpec:
    specs = discover()
    if name not in specs:
        known = ", ".join(specs) or "none installed"
        raise typer.BadParameter(f"unknown service {name!r} (known: {known})")
    return specs[name]


def _specs(only: list[str] | None) -> list[ServiceSpec]:
    return [_spec(name) for name in only] if only else list(discover().values())


@app.command()
def serve(
    name: Annotated[str, typer.Argument(help="service name, e.g. decode")],
    port: Annotated[int | None, typer.Option(help="override the configured port")] = None,
) -> None:
    """Run one service in this process until SIGTERM, then drain."""
    spec = _spec(name)
    spec.apply_environment()
    settings = MeshSettings()
    _refuse_bad_options([spec], settings)
    logs.configure(name)
    tracing.configure(f"aimesh-{name}")
    chosen_port = settings.port_of(name, spec.default_port) if port is None else port
    metrics_port = settings.metrics_port_of(name, chosen_port)

    async def run() -> int:
        server = MeshServer.for_service(name, settings, port=chosen_port)
        await spec.load_setup()(server)
        if metrics_port:
            serve_metrics(metrics_port, settings.service(name).host)
        return await server.serve_until_signal()

    # uvloop, as vLLM's and SGLang's servers run: grpc.aio runs on any asyncio loop, and
    # the loop's own work (tasks, callbacks, the gateway's HTTP sockets) costs less.
    # Imported here: only a serving process needs it.
    import uvloop

    raise typer.Exit(uvloop.run(run()))


@app.command()
def up(
    only: Annotated[
        list[str] | None, typer.Option("--only", help="start just these services")
    ] = None,
    ready_timeout: Annotated[float, typer.Option(help="seconds to wait for readiness")] = 300,
    log_dir: Annotated[
        Path | None, typer.Option(help="write each service's log to DIR/NAME.log")
    ] = None,
    edge: Annotated[
        bool, typer.Option("--edge", help="also start Envoy in front of the mesh (port 8080)")
    ] = False,
    tls: Annotated[
        bool,
        typer.Option(
            "--tls",
            help="mutual TLS between every process: a throwaway CA and a certificate per "
            "service (in --tls-dir), made anew; with --edge, Envoy reaches the services "
            "over it as `edge`, and serves clients TLS with a certificate of that CA for "
            "127.0.0.1 and localhost (unless [edge.tls] names one)",
        ),
    ] = False,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="where --tls writes its CA and certificates; default <cache_dir>/tls"),
    ] = None,
    caller_tokens: Annotated[
        bool,
        typer.Option(
            "--caller-tokens",
            help="with --tls: as behind sidecars that end TLS, plaintext between processes "
            "and each call's caller proven by a token signed with its key",
        ),
    ] = False,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="the LLM to serve: a GGUF file (vocabulary, chat template and limits read "
            "from it) or a Hugging Face directory; sets [engines.llm] model",
        ),
    ] = None,
) -> None:
    """Start every service as its own process, wait until all are ready, run until Ctrl-C."""
    settings = MeshSettings()
    specs = _specs(only)
    environments: dict[str, dict[str, str]] = {spec.name: {} for spec in specs}
    if model is not None:
        settings = _with_model(settings, model.resolve())
        for environment in environments.values():
            environment["AIMESH_ENGINES__LLM__MODEL"] = str(model.resolve())
    _refuse_bad_options(specs, settings)
    _refuse_unloadable(specs, settings)
    edge_settings = settings
    if caller_tokens and not tls:
        raise typer.BadParameter("--caller-tokens signs with --tls's certificates: add --tls")
    if tls:
        names = [*(s.name for s in specs), EDGE, OPERATOR]
        ca = ThrowawayCa(tls_dir or settings.cache_dir / "tls")
        pki = {
            name: ca.identity(name).model_copy(update={"caller_tokens": caller_tokens})
            for name in names
        }
        settings = settings.model_copy(update={"tls": pki[OPERATOR]})
        for spec in specs:
            environments[spec.name] |= tls_environment(pki[spec.name])
        edge_settings = settings.model_copy(update={"tls": pki[EDGE]})
        if edge and edge_settings.edge.tls is None:
            edge_settings = _with_listener_certificate(edge_settings, ca)
        exports = " ".join(
            f"{key}={value}" for key, value in tls_environment(pki[OPERATOR]).items()
        )
        mode = "plaintext with signed caller tokens" if caller_tokens else "mutual TLS"
        console.print(
            f"{mode}: CA {settings.tls.ca_file}; callers from outside use "
            f"{settings.tls.cert_file} and {settings.tls.key_file} (aimesh commands: "
            f"export {exports})",
            soft_wrap=True,
        )
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    # Written before any service starts: a config Envoy could not take (a plaintext
    # listener beyond loopback, say) stops `up` at once, not after minutes of loading.
    edge_config = None
    if edge:
        run_dir = log_dir or settings.cache_dir / "edge"
        edge_config = _edge_config_or_exit(specs, edge_settings, run_dir / "envoy.json")

    async def run() -> int:
        # A SIGTERM while the services start (minutes, with models to load) must stop the
        # ones already started, not leave them running without their supervisor: it
        # cancels this task, and `finally` drains them (SIGINT does so by itself).
        main = asyncio.current_task()
        assert main is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
        children: list[supervisor.Child] = []
        proxy = None
        checker: AuthorizerServer | None = None
        try:
            for spec in specs:
                log = log_dir and log_dir / f"{spec.name}.log"
                children.append(
                    await supervisor.start(spec, settings, log, env=environments.get(spec.name))
                )
            cold_starts = await supervisor.wait_ready(children, ready_timeout, settings.tls)
            infos = await asyncio.gather(
                *(get_info(child.target, tls=settings.tls) for child in children)
            )
            _print_endpoints(children, settings, cold_starts, infos)
            not_ready = [name for name, took in cold_starts.items() if took is None]
            if not_ready:
                console.print(f"[red]not ready: {', '.join(not_ready)}[/red]")
                return 1
            if edge_config is not None:
                _ensure_a_key(edge_settings)
                checker = AuthorizerServer(edge_settings)
                await checker.start()
                proxy = await _start_edge(specs, edge_settings, edge_config, log_dir, ready_timeout)
                if proxy is None:
                    return 1
            console.print("[green]mesh is up[/green]; Ctrl-C drains and stops it")
            await supervisor.until_signal_or_exit(
                children, *([proxy] if proxy else []), on_restart=_say_restart
            )
            return 0
        except asyncio.CancelledError:
            console.print("[yellow]stopped while starting[/yellow]")
            return 128 + signal.SIGTERM
        finally:
            # The edge goes first so that no new request arrives while services drain.
            if proxy is not None:
                await edge_process.stop(proxy)
            if checker is not None:
                await checker.stop()
            grace = max(settings.service(s.name).grace_s for s in specs) + 5
            await supervisor.stop(children, grace)

    raise typer.Exit(asyncio.run(run()))


def _with_model(settings: MeshSettings, model: Path) -> MeshSettings:
    """`up --model`: the settings the services will read with AIMESH_ENGINES__LLM__MODEL."""
    llm = {**settings.engines.get("llm", {}), "model": str(model)}
    return settings.model_copy(update={"engines": {**settings.engines, "llm": llm}})


def _refuse_bad_options(specs: list[ServiceSpec], settings: MeshSettings) -> None:
    problems = options_problems(specs, settings)
    if problems:
        for problem in problems:
            console.print(f"[red]{problem}[/red]")
        raise typer.Exit(2)


def _refuse_unloadable(specs: list[ServiceSpec], settings: MeshSettings) -> None:
    """A model that cannot be read or does not fit stops `up` before anything starts."""
    problems = preflight_problems(specs, settings)
    if problems:
        for problem in problems:
            console.print(f"[red]{problem}[/red]", soft_wrap=True)
        raise typer.Exit(2)


def _say_restart(child: supervisor.Child, exit_code: int, delay_s: float) -> None:
    console.print(
        f"[yellow]{child.spec.name} exited with status {exit_code}; restarting it in "
        f"{delay_s:g} s (restart {child.restarts + 1})[/yellow]"
    )


def _ensure_a_key(settings: MeshSettings) -> None:
    """With no key configured, one made up for this run (every scope), and said."""
    if not settings.edge.api_keys and settings.edge.api_keys_file is None:
        key = secrets.token_urlsafe(24)
        settings.edge.api_keys = [SecretStr(key)]
        console.print(f"edge API key for this run (set AIMESH_EDGE__API_KEYS to fix one): {key}")


def _with_listener_certificate(settings: MeshSettings, ca: ThrowawayCa) -> MeshSettings:
    """`up --tls --edge`: the edge listener on a certificate of the throwaway CA for the
    addresses a client here dials (127.0.0.1, localhost, edge.host if another), and where
    clients find the CA to trust it."""
    hosts = ["127.0.0.1", "localhost"]
    if settings.edge.host not in ("0.0.0.0", "::", *hosts):
        hosts.append(settings.edge.host)
    listener = ca.listener(EDGE_LISTENER, hosts)
    console.print(
        f"edge: TLS for clients with {listener.cert_file} ({', '.join(hosts)}); "
        f"clients trust the CA {ca.ca_file} (curl --cacert, grpcurl -cacert, grpc "
        "root_certificates, httpx verify)",
        soft_wrap=True,
    )
    return settings.model_copy(update={"edge": settings.edge.model_copy(update={"tls": listener})})


def _write_edge_config(specs: list[ServiceSpec], settings: MeshSettings, path: Path) -> Path:
    """The same Envoy config for `up --edge` and `edge render` (spans go where ours do),
    with its SDS files under [tls] or [edge.tls] (beside it unless edge.sds_dir says where)."""
    mesh_tls = settings.tls is not None and terminates_here(settings.tls)
    if (mesh_tls or settings.edge.tls is not None) and settings.edge.sds_dir is None:
        settings.edge.sds_dir = path.parent
    config = envoy.bootstrap(
        envoy.upstreams_for(specs, settings), settings, otlp_endpoint=tracing.otlp_endpoint()
    )
    return edge_process.write_config(config, path, envoy.sds_documents(settings))


def _edge_config_or_exit(specs: list[ServiceSpec], settings: MeshSettings, path: Path) -> Path:
    """_write_edge_config, or the settings' problem said and exit status 2."""
    try:
        return _write_edge_config(specs, settings, path)
    except ValueError as problem:
        console.print(f"[red]{escape(str(problem))}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


async def _start_edge(
    specs: list[ServiceSpec],
    settings: MeshSettings,
    config: Path,
    log_dir: Path | None,
    timeout_s: float,
) -> asyncio.subprocess.Process | None:
    """Envoy on its `config` in front of the running services, its authorizer
    already listening."""
    proxy = await edge_process.start(
        settings.edge.envoy_binary, config, log_dir and log_dir / "envoy.log"
    )
    try:
        ready = await edge_process.wait_ready(proxy, settings.edge.admin_port, timeout_s)
    except asyncio.CancelledError:  # a SIGTERM while Envoy starts: it goes too
        await edge_process.stop(proxy)
        raise
    if not ready:
        console.print(f"[red]envoy did not become ready; its config is {config}[/red]")
        await edge_process.stop(proxy)
        return None
    edge = settings.edge
    http = [path for spec in specs for path in spec.edge_http_paths]
    also = f", and {', '.join(http)} as they are" if http else ""
    scheme = "http" if edge.tls is None else "https"
    console.print(
        f"[green]edge[/green] gRPC, gRPC-Web and JSON{also} on {scheme}://{edge.host}:{edge.port}; "
        f"admin http://127.0.0.1:{edge.admin_port}"
    )
    return proxy


def _print_endpoints(
    children: list[supervisor.Child],
    settings: MeshSettings,
    cold_starts: dict[str, float | None],
    infos: list[GetInfoResponse | None],
) -> None:
    columns = ("service", "address", "metrics", "pid", "state", "cold start", "models")
    table = Table(*columns, title="aimesh services")
    for child, info in zip(children, infos, strict=True):
        name = child.spec.name
        port = settings.port_of(name, child.spec.default_port)
        metrics_port = settings.metrics_port_of(name, port)
        table.add_row(
            name,
            child.target,
            f"http://{settings.service(name).host}:{metrics_port}/metrics" if metrics_port else "-",
            str(child.process.pid),
            "[red]not ready[/red]" if cold_starts[name] is None else "[green]ready[/green]",
            "-" if cold_starts[name] is None else f"{cold_starts[name]:.1f} s",
            _models(info),
        )
    console.print(table)


def _models(info: GetInfoResponse | None) -> str:
    if info is None:
        return "-"
    return "; ".join(summary(model) for model in info.models) or "-"


@app.command()
def health(
    only: Annotated[
        list[str] | None, typer.Option("--only", help="check just these services")
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds per probe")] = 1.0,
) -> None:
    """Liveness and readiness of every service (diagnostic ones such as echo only when
    named); exit 0 only if all are ready."""
    settings = MeshSettings()
    specs = _specs(only) if only else [s for s in discover().values() if not s.diagnostic]

    async def run() -> list[tuple[str, str, str, str, GetInfoResponse | None]]:
        async def one(spec: ServiceSpec) -> tuple[str, str, str, str, GetInfoResponse | None]:
            target = settings.target_of(spec.name, spec.default_port)
            live, ready, info = await asyncio.gather(
                probe(target, "", timeout, settings.tls),
                probe(target, spec.name, timeout, settings.tls),
                get_info(target, timeout, settings.tls),
            )
            return spec.name, target, live, ready, info

        return list(await asyncio.gather(*(one(spec) for spec in specs)))

    rows = asyncio.run(run())
    table = Table("service", "address", "live", "ready", "models", title="aimesh health")
    for name, target, live, ready, info in rows:
        colour = "green" if ready == "SERVING" else "red"
        table.add_row(name, target, live, f"[{colour}]{ready}[/{colour}]", _models(info))
    console.print(table)
    all_ready = bool(rows) and all(row[3] == "SERVING" for row in rows)
    raise typer.Exit(0 if all_ready else 1)


@edge_app.command("render")
def edge_render(
    out: Annotated[Path, typer.Option(help="where to write Envoy's config (JSON, valid YAML)")],
    only: Annotated[
        list[str] | None, typer.Option("--only", help="front just these services")
    ] = None,
) -> None:
    """Write Envoy's config for the configured mesh: routes from the protos, upstreams from
    the service table, tracing from OTEL_*. It holds no key: `aimesh edge authorize` does."""
    settings = MeshSettings()
    _edge_config_or_exit(_specs(only), settings, out)
    console.print(f"wrote {out}")


@edge_app.command("authorize")
def edge_authorize() -> None:
    """Check the edge's API keys for Envoy beside it (127.0.0.1:edge.authorizer_port):
    keys from edge.api_keys_file (re-read when it changes) or AIMESH_EDGE__API_KEYS."""
    settings = MeshSettings()

    async def serve() -> None:
        checker = AuthorizerServer(settings)
        await checker.start()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await checker.stop()

    asyncio.run(serve())


def _add_service_commands() -> None:
    """Services contribute their own commands (e.g. `generate`, or a group such as
    `models`) through the `aimesh.commands` entry-point group, so this CLI stays
    ignorant of them."""
    for entry in entry_points(group="aimesh.commands"):
        command = entry.load()
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=entry.name)
        else:
            app.command(entry.name)(command)


_add_service_commands()

if __name__ == "__main__":
    app()
