"""How services plug into the mesh without the mesh knowing them.

Each service package declares a ServiceSpec and registers it under the `aimesh.services`
entry-point group in pyproject.toml. The spec module must stay cheap to import: `aimesh up`
and `aimesh health` read every spec, and only `aimesh serve NAME` imports the setup
function (and with it torch, models and so on).
"""

from __future__ import annotations

import os
import pkgutil
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from pydantic import ValidationError

from mesh.config import MeshSettings, ServiceOptions

if TYPE_CHECKING:
    from mesh.server import MeshServer

ENTRY_POINT_GROUP = "aimesh.services"


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    default_port: int
    description: str
    # "package.module:function"; the function registers servicers on the server (before it
    # starts) and may add warm-ups that run before readiness flips to SERVING.
    setup: str
    # Full method names ('/pkg.Service/Method') that bypass admission: cheap control calls.
    exempt_methods: tuple[str, ...] = field(default=())
    # Compute slots when the config sets none: a service whose calls are long streams that
    # batch together (decode, the router) needs far more than one doing CPU work per call.
    max_concurrency: int = 4
    # Proto services (full names) Envoy exposes to the outside; the rest (KV pull, decode,
    # the echo relay that dials any address it is given) stay inside the mesh.
    edge_services: tuple[str, ...] = field(default=())
    # Services this one calls, by name: MeshServer.channel_to hands out channels to these
    # only, so the call graph is written down in one place per service.
    dependencies: tuple[str, ...] = field(default=())
    # Who may call it under mutual TLS (mesh/authz.py): (proto service full name, or a
    # method '/pkg.Service/Method' that narrows it, caller names). The same call graph
    # seen from the callee; tests/mesh/test_authz.py holds the two sides to each other.
    callers: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())
    # The scope an edge key needs (mesh/keys.py: read, generate, embed, images, write,
    # admin) per proto service of edge_services or per method narrowing it; a method of
    # neither is refused to every key (mesh/edge/authorizer.py).
    scopes: tuple[tuple[str, str], ...] = field(default=())
    # HTTP paths the edge routes to the service's own HTTP listener as they are (its
    # options must be a mesh.config.HttpServiceOptions); one ending in "/" is a prefix.
    edge_http_paths: tuple[str, ...] = field(default=())
    # A diagnostic service (echo) is no part of a deployment: k8s/render.py leaves it out
    # of k8s/base and writes it to k8s/components/diagnostics for an overlay that wants it.
    diagnostic: bool = False
    # "package.module:Class": the mesh.config.ServiceOptions model of the service's own
    # keys in [services.<name>]; the module must be cheap to import. None: it has none.
    options: str | None = None
    # Process environment defaults `aimesh serve` sets before the setup's modules load (a
    # value the user set wins): for native runtimes that read theirs once, when loaded.
    environment: tuple[tuple[str, str], ...] = field(default=())
    # "package.module:function" taking the MeshSettings and returning one line per problem
    # that would stop the service loading (a model file that cannot be read, or that does
    # not fit in memory): `aimesh up` runs each distinct one before anything starts.
    preflight: str | None = None

    def apply_environment(self) -> None:
        for key, value in self.environment:
            os.environ.setdefault(key, value)

    def load_options(self) -> type[ServiceOptions]:
        return ServiceOptions if self.options is None else pkgutil.resolve_name(self.options)

    def load_setup(self) -> Callable[[MeshServer], Awaitable[None]]:
        return pkgutil.resolve_name(self.setup)


def options_problems(specs: Iterable[ServiceSpec], settings: MeshSettings) -> list[str]:
    """Every service's own settings checked before anything starts: one line per problem,
    naming the table and key (a typo or a bad value fails the start, not a request)."""
    problems = []
    for spec in specs:
        try:
            spec.load_options().of(settings, spec.name)
        except ValidationError as error:
            for problem in error.errors():
                key = ".".join(str(part) for part in problem["loc"])
                problems.append(f"[services.{spec.name}] {key}: {problem['msg']}")
    return problems


def preflight_problems(specs: Iterable[ServiceSpec], settings: MeshSettings) -> list[str]:
    """The services' own checks of what they will load (ServiceSpec.preflight), each
    distinct one once: what `aimesh up` refuses to start with."""
    checks = dict.fromkeys(spec.preflight for spec in specs if spec.preflight is not None)
    return [line for check in checks for line in pkgutil.resolve_name(check)(settings)]


def discover() -> dict[str, ServiceSpec]:
    """Every installed service, by name, in port order (the order `aimesh up` starts them)."""
    specs = [entry.load() for entry in entry_points(group=ENTRY_POINT_GROUP)]
    return {spec.name: spec for spec in sorted(specs, key=lambda s: s.default_port)}
