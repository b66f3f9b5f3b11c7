"""Typed settings for the whole mesh: one TOML file plus environment overrides.

Precedence: explicit arguments > environment (AIMESH_*, nested with `__`, e.g.
AIMESH_SERVICES__DECODE__PORT=50163) > the TOML file named by AIMESH_CONFIG > defaults.
Each service's default port comes from its ServiceSpec; this file only holds overrides,
so mesh/ stays ignorant of which services exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import typing
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mesh.buckets import STORE_PATTERN

LOOPBACK = "127.0.0.1"


class ServiceSettings(BaseModel):
    """Where one service listens, how it is reached, and its compute budget; every other
    key in `[services.<name>]` is the service's own, validated by the ServiceOptions
    model its spec names (`MeshServer.options_as`, and `aimesh up` before it starts)."""

    model_config = ConfigDict(extra="allow")

    host: str = LOOPBACK
    port: int | None = Field(default=None, ge=0, le=65535, description="None: the spec's port")
    target: str | None = Field(
        default=None,
        description="What clients dial, e.g. dns:///decode.aimesh.svc:50063; None: host:port",
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="None: port + 1000; 0: no exposition"
    )
    max_concurrency: int | None = Field(
        default=None, ge=1, description="compute slots; None: the service's own default"
    )
    max_queue: int = Field(default=64, ge=0)
    grace_s: float = Field(default=15.0, ge=0, description="SIGTERM drain period")
    dependencies: dict[str, str] = Field(
        default_factory=dict,
        description="service name -> the address this service dials for it, overriding that "
        "service's own target (e.g. a proxy on one edge)",
    )

    def own(self) -> dict[str, Any]:
        """The service's own keys: everything this model does not define."""
        return dict(self.model_extra or {})


def _is_text(annotation: Any) -> bool:
    """Whether a field's type takes a plain string (an environment value as it is)."""
    return annotation is str or any(_is_text(arg) for arg in typing.get_args(annotation))


class ServiceOptions(BaseModel):
    """Base of a service's own settings (the rest of its `[services.<name>]` table).

    Unknown keys are refused, so a typo fails the start instead of being ignored. A value
    from the environment arrives as a string even for a list or a table
    (AIMESH_SERVICES__GENERATION__DECODE='["127.0.0.1:1"]'): pydantic-settings decodes
    JSON only for fields it knows the type of, and these it cannot, so it is decoded here.
    """

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def of(cls, settings: MeshSettings, service: str) -> Self:
        """`service`'s own keys of its [services.<name>] table, validated."""
        return cls.model_validate(settings.service(service).own())

    @model_validator(mode="before")
    @classmethod
    def _decode_json_strings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        decoded = dict(data)
        for name, field in cls.model_fields.items():
            value = decoded.get(name)
            if isinstance(value, str) and not _is_text(field.annotation):
                # Not JSON: left as it is, for the field's own validation to name.
                with contextlib.suppress(ValueError):
                    decoded[name] = json.loads(value)
        return decoded


class HttpServiceOptions(ServiceOptions):
    """The keys of a service that serves HTTP beside its gRPC port: the edge routes its
    ServiceSpec.edge_http_paths to `http_port`, and Kubernetes exposes that port."""

    http_port: int = Field(default=8000, ge=0, le=65535, description="0: any free port")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="budget of one HTTP request across every hop"
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="the service checks API keys itself, from this file (re-read when it "
        "changes); the edge then lets the Authorization header through. None: no keys",
    )


class BreakerSettings(BaseModel, frozen=True):
    window_size: int = Field(default=20, ge=1)
    minimum_calls: int = Field(default=10, ge=1)
    failure_rate: float = Field(default=0.5, gt=0, le=1)
    slow_call_rate: float = Field(default=0.8, gt=0, le=1)
    slow_call_s: float = Field(default=5.0, gt=0)
    open_wait_s: float = Field(default=5.0, ge=0)
    half_open_calls: int = Field(default=3, ge=1)
    sane_deadline_s: float = Field(
        default=1.0,
        ge=0,
        description="DEADLINE_EXCEEDED trips the breaker only if the call had this long",
    )


class ClientSettings(BaseModel):
    deadline_margin_s: float = Field(default=0.01, ge=0)
    # grpc-timeout is rounded up on the wire (about 3 significant digits, up to ~0.5%), so a
    # fixed margin alone vanishes on long budgets. On a connection that already carried a
    # similar timeout, grpc's HPACK encoder may even resend that one if it is at most 3%
    # longer: the callee's time_remaining() can read slightly above what was asked. The
    # caller's own deadline is exact and cancels the call on time either way.
    deadline_margin_ratio: float = Field(default=0.01, ge=0, lt=0.5)
    default_unary_deadline_s: float = Field(default=10.0, gt=0)
    default_stream_deadline_s: float = Field(default=300.0, gt=0)
    method_deadlines_s: dict[str, float] = Field(
        default_factory=dict, description="'/pkg.Service/Method' -> default deadline"
    )
    retry_max_attempts: int = Field(default=3, ge=2, le=5)
    retry_initial_backoff_s: float = Field(default=0.1, gt=0)
    retry_max_backoff_s: float = Field(default=2.0, gt=0)
    # grpc's reconnect backoff grows 1.6x up to 120 s by default: a callee down for T
    # seconds was retried up to ~0.6 T after it came back. Capped, a restarted service is
    # found again within a couple of seconds of its readiness (grpc adds 20% jitter).
    reconnect_initial_backoff_s: float = Field(default=0.5, gt=0)
    reconnect_max_backoff_s: float = Field(default=2.0, gt=0)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)


class TransportSettings(BaseModel):
    """Options both ends must agree on; set explicitly, never left to grpc's defaults."""

    max_message_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    keepalive_time_s: float = Field(default=30.0, gt=0)
    keepalive_timeout_s: float = Field(default=10.0, gt=0)
    max_concurrent_streams: int = Field(default=1024, ge=1)
    max_connection_age_s: float | None = Field(
        default=None, description="Set in Kubernetes so round_robin clients see new pods"
    )
    max_connection_age_grace_s: float = Field(default=30.0, ge=0)


class EdgeTlsSettings(BaseModel, extra="forbid"):
    """[edge.tls]: the certificate Envoy's listener serves to clients outside the mesh.
    Envoy reads both files through file-based SDS watching the certificate's directory, so
    a renewed pair moved in there (a Kubernetes Secret's swap, an os.replace) is served
    without a restart; keep the key in the same directory."""

    cert_file: Path = Field(description="the listener's certificate chain, PEM")
    key_file: Path = Field(description="its private key, PEM")


class EdgeSettings(BaseModel):
    """Envoy at the edge: what it listens on and what it lets through.

    Everything else in Envoy's config (routes, timeouts, retries, outlier detection,
    circuit breakers) is derived from the protos and the client/breaker settings, so the
    edge and the in-process clients cannot drift apart.
    """

    host: str = LOOPBACK
    port: int = Field(default=8080, ge=1, le=65535)
    tls: EdgeTlsSettings | None = Field(
        default=None,
        description="TLS on the listener (ALPN h2 and http/1.1); None: plaintext, which "
        "the edge serves on a loopback host only, unless tls_ends_in_front",
    )
    tls_ends_in_front: bool = Field(
        default=False,
        description="clients reach the edge through a proxy that ends their TLS (an "
        "ingress, a cloud load balancer): a plaintext listener on a non-loopback host is "
        "then the operator's choice, not a mistake",
    )
    admin_port: int = Field(default=9901, ge=1, le=65535, description="Envoy admin, loopback only")
    metrics_host: str = Field(
        default=LOOPBACK, description="where /stats/prometheus listens (0.0.0.0 in a pod)"
    )
    metrics_port: int = Field(
        default=9902, ge=0, le=65535, description="/stats/prometheus on metrics_host; 0: none"
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="keys in clear text (tenants key-1, key-2, ..., every scope), for a "
        "machine of one's own; else api_keys_file",
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="sha256 digests of keys with their tenants and scopes (mesh/keys.py), "
        "re-read when the file changes",
    )
    authorizer_port: int = Field(
        default=9903, ge=1, le=65535, description="the edge's key checker, loopback only"
    )
    sds_dir: Path | None = Field(
        default=None,
        description="with [tls] or [edge.tls]: where the files naming Envoy's certificates "
        "and CA are written (file-based SDS, so renewed certificates are read again); "
        "`aimesh up` and `aimesh edge render` put them beside Envoy's config unless set",
    )
    cors_allow_origins: list[str] = Field(
        default_factory=list,
        description="browser origins allowed to call gRPC-Web and JSON ('*': any); none: "
        "no cross-origin calls",
    )
    trusted_hops: int = Field(
        default=0,
        ge=0,
        description="proxies in front of Envoy whose x-forwarded-for entries are believed "
        "(a cloud load balancer: 1); the client's own are never",
    )
    max_request_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="largest request body a unary route takes (413 past it); client "
        "streams are bounded per message by transport.max_message_bytes",
    )
    route_max_request_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="per-route overrides of max_request_bytes: a gRPC method path "
        "('/aimesh.retrieval.v1.EmbedderService/Embed') or an HTTP path ('/v1/embeddings')",
    )
    max_heap_bytes: int = Field(
        default=1024**3,
        ge=64 * 1024**2,
        description="Envoy's heap: it frees memory past 95% and takes no new requests past 98%",
    )
    max_connections: int = Field(default=10_000, ge=1, description="downstream connections")
    http2_max_concurrent_streams: int = Field(default=100, ge=1, le=2**31 - 1)
    request_headers_timeout_s: float = Field(
        default=10.0, gt=0, description="a client must send its headers within this"
    )
    idle_timeout_s: float = Field(
        default=3600.0, gt=0, description="a downstream connection with no stream is closed"
    )
    rate_limit_per_s: int = Field(default=200, ge=1, description="requests/s per Envoy process")
    rate_limit_burst: int = Field(default=400, ge=1)
    dns_replicas: int = Field(
        default=8,
        ge=1,
        description="most replicas a dns:/// service scales to; sizes Envoy's circuit breakers",
    )
    grpc_timeout_offset_s: float = Field(
        default=0.05, ge=0, description="Envoy gives up this much before the client's deadline"
    )
    health_check_interval_s: float = Field(default=2.0, gt=0)
    connect_timeout_s: float = Field(default=1.0, gt=0)
    envoy_binary: str = Field(default="envoy", description="path or name on PATH")


class LimitsSettings(BaseModel):
    """[limits]: tenants' limits and the usage ledger, one for every door (mesh/metering.py).
    The edge's authorizer and the gateway charge a request to its tenant's
    requests_per_minute where it enters; the generation router charges the tokens of every
    generation, whoever sent it (the gateway, the edge's gRPC and JSON routes, an agent's
    run), and writes the ledger."""

    model_config = ConfigDict(extra="forbid")

    tenants_file: Path | None = Field(
        default=None,
        description="the file whose [tenants.NAME] tables set each tenant's limits (it may be "
        "the API key file itself); re-read when it changes; none: no tenant is limited",
    )
    store: str = Field(
        default="sqlite",
        pattern=STORE_PATTERN,
        description='where buckets, budgets and the ledger live: "sqlite" '
        '(<cache_dir>/limits.sqlite, shared by every process of this machine), "sqlite:PATH", '
        '"memory" (this process only), or a Redis URL shared by every machine',
    )
    window_s: float = Field(
        default=60.0,
        gt=0,
        description="the period the *_per_minute buckets refill over (60; shorter in tests)",
    )
    reserve_tokens: int = Field(
        default=256,
        ge=1,
        description="completion tokens a generation without max_new_tokens reserves (and may "
        "then generate at most) when its tenant has token limits",
    )


class TlsSettings(BaseModel, extra="forbid"):
    """[tls]: TLS between mesh processes (mesh/tls.py); absent, everything is plaintext."""

    cert_file: Path = Field(description="this process's certificate chain, PEM")
    key_file: Path = Field(description="its private key, PEM")
    ca_file: Path = Field(description="the CA that signs every mesh certificate, PEM")
    require_client_cert: bool = Field(
        default=True, description="mutual TLS: refuse callers without a certificate of the CA"
    )
    authorize_callers: bool = Field(
        default=True,
        description="check each caller's certificate identity against the method's allow-list "
        "(mesh/authz.py); needs require_client_cert",
    )

    caller_tokens: bool = Field(
        default=False,
        description="TLS ends before this process (a sidecar proxy encrypts the hop): listen "
        "and dial in plaintext, and prove each caller's identity with a token signed by its "
        "key instead (mesh/caller_token.py)",
    )
    health_port_offset: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="also answer grpc.health.v1, and nothing else, in plaintext on the gRPC "
        "port + this, for probes that cannot present a certificate (the kubelet's gRPC "
        "probes); None: no such port",
    )

    @model_validator(mode="after")
    def _identity_needs_client_certs(self) -> Self:
        if self.authorize_callers and not self.require_client_cert:
            raise ValueError("authorize_callers needs require_client_cert (callers' identities)")
        if self.caller_tokens and not self.authorize_callers:
            raise ValueError("caller_tokens without authorize_callers would serve anyone")
        return self


class MeshSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AIMESH_", env_nested_delimiter="__")

    services: dict[str, ServiceSettings] = Field(default_factory=dict)
    # Settings several services share, by engine name (e.g. [engines.llm] model = "...",
    # read by tokenizer, prefill and decode alike); each engine validates its own section.
    engines: dict[str, dict[str, Any]] = Field(default_factory=dict)
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "aimesh",
        description="Converted models, indexes and other artifacts built once and reused",
    )
    client: ClientSettings = Field(default_factory=ClientSettings)
    transport: TransportSettings = Field(default_factory=TransportSettings)
    edge: EdgeSettings = Field(default_factory=EdgeSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    # None: plaintext (the loopback default); mesh/tls.py.
    tls: TlsSettings | None = None
    deployments: str = Field(
        default="file",
        description="the model registry (mesh/deployments.py): 'file' for "
        "<cache_dir>/deployments.json, another file's path, or a Redis URL shared by replicas",
    )
    reflection: bool = Field(
        default=True,
        description="gRPC server reflection (grpcurl without .proto files); off in production: "
        "it hands every caller the full API",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = os.environ.get("AIMESH_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)

    def service(self, name: str) -> ServiceSettings:
        return self.services.get(name) or ServiceSettings()

    def port_of(self, name: str, default_port: int) -> int:
        port = self.service(name).port
        return default_port if port is None else port

    def target_of(self, name: str, default_port: int) -> str:
        """The address a client dials for service `name`."""
        service = self.service(name)
        return service.target or f"{service.host}:{self.port_of(name, default_port)}"

    def metrics_port_of(self, name: str, default_port: int) -> int:
        metrics_port = self.service(name).metrics_port
        if metrics_port is None:
            port = self.port_of(name, default_port)
            return 0 if port == 0 else port + 1000
        return metrics_port
