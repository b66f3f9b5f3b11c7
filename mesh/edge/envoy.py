"""Envoy's bootstrap config for the edge, derived from the protos and the mesh settings.

One listener takes gRPC, gRPC-Web and JSON (grpc_json_transcoder over the protos'
`google.api.http` annotations) for the services that declare `edge_services`; nothing
else is routed, so reflection, health and internal services stay inside the mesh.
Per method: streams get no route timeout (a stream lasts as long as it needs, up to the
mesh's stream deadline), unary calls get the mesh's default deadline, a client's own
grpc-timeout is honoured up to the stream cap, and only methods the protos mark
idempotent are retried on UNAVAILABLE. Per upstream: gRPC health checks on the service's
readiness name, and outlier detection and circuit breakers sized from the same breaker
and admission settings the in-process clients use.

A service that serves HTTP beside gRPC (its ServiceSpec.edge_http_paths, on the
`http_port` of its mesh.config.HttpServiceOptions) gets those paths routed to that port
as plain HTTP/1.1, with the transcoder off, nothing buffered (server-sent events pass as
they come) and a timeout as long as the service's own request budget. Where it checks
API keys itself (its `api_keys_file`), the edge's key check is off on those routes too
and `authorization` reaches it untouched.

Clients outside reach the listener over TLS when `[edge.tls]` names a certificate and key
(read by file-based SDS, so a renewed pair is served without a restart), with ALPN
offering h2 and http/1.1; plaintext only on a loopback host, or where the operator says a
proxy in front ends the clients' TLS (`edge.tls_ends_in_front`).
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2, status_pb2

from mesh import targets
from mesh.authz import identity_uri
from mesh.config import EdgeTlsSettings, HttpServiceOptions, MeshSettings, TlsSettings
from mesh.edge import api, authorizer
from mesh.registry import ServiceSpec
from mesh.tls import terminates_here

ADMIN_CLUSTER = "envoy_admin"
COLLECTOR_CLUSTER = "otel_collector"
EDGE_SERVICE_NAME = "aimesh-edge"
# Headers a browser may send and read across origins: gRPC-Web's own, auth, tracing.
CORS_ALLOW_HEADERS = (
    "authorization,x-api-key,content-type,x-grpc-web,x-user-agent,grpc-timeout,"
    "traceparent,tracestate,x-request-id"
)
CORS_EXPOSE_HEADERS = "grpc-status,grpc-message,grpc-status-details-bin,x-request-id"
# Retried only when the request never reached a service, whatever the method.
NEVER_SENT = "connect-failure,refused-stream"
HTTP_CONNECTION_MANAGER = (
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
EXT_AUTHZ = "envoy.filters.http.ext_authz"
AUTHORIZER_CLUSTER = "edge_authorizer"
# An HTTP API answers its own timeout (in its own error shape) before the edge gives up.
HTTP_TIMEOUT_MARGIN_S = 5.0
BUFFER = "envoy.filters.http.buffer"
# Envoy's edge guide: per-connection buffers of 32 KiB downstream and upstream, HTTP/2
# windows of 64 KiB per stream and 1 MiB per connection, so a slow or hostile client
# cannot make Envoy hold much of anything for it.
BUFFER_LIMIT_BYTES = 32 * 1024
HTTP2_STREAM_WINDOW_BYTES = 64 * 1024
HTTP2_CONNECTION_WINDOW_BYTES = 1024 * 1024


@dataclass(frozen=True)
class HttpApi:
    """The HTTP API a service serves beside its gRPC port."""

    paths: tuple[str, ...]  # ServiceSpec.edge_http_paths
    port: int
    own_keys: bool  # the service checks API keys itself: the edge lets them through
    budget_s: float  # the longest one request may take, streams included


@dataclass(frozen=True)
class Upstream:
    """One mesh service behind the edge (an Envoy cluster, two with an HTTP API)."""

    name: str  # also the readiness name its health checks ask for
    target: str  # what mesh clients dial: host:port, ipv4:a:p,b:p or dns:///host:port
    services: tuple[ServiceDescriptor, ...]
    requests_per_replica: int  # compute slots + queue: more is refused by admission anyway
    http: HttpApi | None = None

    @property
    def http_cluster(self) -> str:
        return f"{self.name}-http"


def http_api(spec: ServiceSpec, settings: MeshSettings) -> HttpApi | None:
    """The HTTP API `spec` declares (edge_http_paths), None if it declares none."""
    if not spec.edge_http_paths:
        return None
    options = spec.load_options().of(settings, spec.name)
    if not isinstance(options, HttpServiceOptions):
        raise TypeError(f"{spec.name} declares edge_http_paths; its options need an http_port")
    if options.http_port == 0:
        raise ValueError(
            f"[services.{spec.name}] http_port is 0 (any free port): the edge routes its "
            "HTTP API to a fixed port, so set one"
        )
    return HttpApi(
        paths=spec.edge_http_paths,
        port=options.http_port,
        own_keys=options.api_keys_file is not None,
        budget_s=options.request_timeout_s,
    )


def upstreams_for(specs: list[ServiceSpec], settings: MeshSettings) -> list[Upstream]:
    upstreams = []
    for spec in specs:
        http = http_api(spec, settings)
        if not spec.edge_services and http is None:
            continue
        service = settings.service(spec.name)
        slots = service.max_concurrency or spec.max_concurrency
        upstreams.append(
            Upstream(
                name=spec.name,
                target=settings.target_of(spec.name, spec.default_port),
                services=tuple(api.load_services(spec.edge_services)),
                requests_per_replica=slots + service.max_queue,
                http=http,
            )
        )
    claimed: dict[str, str] = {}
    for upstream in upstreams:
        for path in upstream.http.paths if upstream.http else ():
            if path in claimed:
                raise ValueError(f"{claimed[path]} and {upstream.name} both claim {path}")
            claimed[path] = upstream.name
    return upstreams


def endpoints(target: str) -> tuple[str, list[tuple[str, int]]]:
    """Envoy's discovery type and the (host, port) list for a gRPC target string."""
    named, pairs = targets.endpoints(target)
    return ("STRICT_DNS" if named else "STATIC"), pairs


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _http2_cluster_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}},
        )
    }


def _static_cluster(name: str, host: str, port: int, *, http2: bool) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host, port)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = _http2_cluster_options()
    return cluster


def _retry_policy(retry_on: str, settings: MeshSettings) -> dict[str, Any]:
    client = settings.client
    return {
        "retry_on": retry_on,
        "num_retries": client.retry_max_attempts - 1,
        "retry_back_off": {
            "base_interval": _seconds(client.retry_initial_backoff_s),
            "max_interval": _seconds(client.retry_max_backoff_s),
        },
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": _typed(
                    "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                ),
            }
        ],
        # Least-request balancing picks the less busy of two random hosts, and a host
        # that only fails is never busy: with 3 picks a retry landed on the dead replica
        # again 1 time in 8 with two replicas (a client-visible failure in CI before its
        # ejection); 10 picks make that 1 in 1024 per retry.
        "host_selection_retry_max_attempts": 10,
    }


def route(method: api.EdgeMethod, cluster: str, settings: MeshSettings) -> dict[str, Any]:
    client = settings.client
    streaming = method.server_streaming or method.client_streaming
    default_s = client.method_deadlines_s.get(
        method.path,
        client.default_stream_deadline_s if streaming else client.default_unary_deadline_s,
    )
    retry_on = f"unavailable,{NEVER_SENT}" if method.idempotent else NEVER_SENT
    return {
        # Not `grpc: {}`: a browser's CORS preflight (OPTIONS, no gRPC content type) must
        # match the route too, or the CORS filter lets it through to auth.
        "match": {"path": method.path},
        # A client stream is bounded per message by the services' max_message_bytes; a
        # whole body waits in the buffer filter only where one message is the body.
        "typed_per_filter_config": {
            BUFFER: NO_BODY_LIMIT if method.client_streaming else body_limit(method.path, settings)
        },
        "route": {
            "cluster": cluster,
            # No per-route response timeout: the deadline is the stream's whole duration,
            # the client's grpc-timeout (capped) or else the mesh's default for the method.
            "timeout": "0s",
            "max_stream_duration": {
                "max_stream_duration": _seconds(default_s),
                "grpc_timeout_header_max": _seconds(client.default_stream_deadline_s),
                "grpc_timeout_header_offset": _seconds(settings.edge.grpc_timeout_offset_s),
            },
            "retry_policy": _retry_policy(retry_on, settings),
        },
    }


def _disabled() -> dict[str, Any]:
    """A route's typed_per_filter_config entry that turns an HTTP filter off there."""
    return _typed("envoy.config.route.v3.FilterConfig", disabled=True)


# The buffer filter's per-route configs are read when its turn comes, after the
# transcoder has turned a JSON request into its gRPC method's path and route (a filter
# turned off with FilterConfig would be decided on the JSON path, before that).
NO_BODY_LIMIT = _typed("envoy.extensions.filters.http.buffer.v3.BufferPerRoute", disabled=True)
# Anything else: 404 (UNIMPLEMENTED to a gRPC client) at once, its body never awaited (a
# reflection stream, which never ends, would otherwise wait in the buffer filter).
NOT_ROUTED = {
    "match": {"prefix": "/"},
    "direct_response": {"status": 404},
    "typed_per_filter_config": {BUFFER: NO_BODY_LIMIT},
}


def body_limit(path: str, settings: MeshSettings) -> dict[str, Any]:
    """The buffer filter's limit on one route: a body past it is answered 413 at the edge
    before any of it reaches a service."""
    edge = settings.edge
    limit = edge.route_max_request_bytes.get(path, edge.max_request_bytes)
    return _typed(
        "envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
        buffer={"max_request_bytes": limit},
    )


def http_routes(upstream: Upstream, settings: MeshSettings) -> list[dict[str, Any]]:
    """`upstream`'s HTTP paths, to its HTTP API as they are."""
    http = upstream.http
    if http is None:
        return []
    # The transcoder never sees these requests (with reject_unknown_method it would
    # answer 404); the key check only where the service does not check keys itself.
    off = {TRANSCODER: _disabled()}
    if http.own_keys:
        off[EXT_AUTHZ] = _disabled()
    limit = _seconds(http.budget_s + HTTP_TIMEOUT_MARGIN_S)

    def to_http(match: dict[str, str]) -> dict[str, Any]:
        action = {
            "cluster": upstream.http_cluster,
            # A server-sent event stream lasts as long as the generation: no response
            # timeout; a non-streamed completion sends nothing until it is done, so the
            # idle timeout (5 min by default) is the service's whole budget; the service
            # answers its own timeout first.
            "timeout": "0s",
            "idle_timeout": limit,
            "max_stream_duration": {"max_stream_duration": limit},
            # A completion is no idempotent call: retried only when it never left Envoy.
            "retry_policy": _retry_policy(NEVER_SENT, settings),
        }
        limits = {BUFFER: body_limit(next(iter(match.values())), settings)}
        return {"match": match, "route": action, "typed_per_filter_config": {**off, **limits}}

    return [to_http({"prefix" if path.endswith("/") else "path": path}) for path in http.paths]


def _cluster(
    name: str,
    service: str,
    target: str,
    port: int | None,
    settings: MeshSettings,
    *,
    health_check: dict[str, Any],
    outlier_detection: dict[str, Any],
    requests_per_replica: int,
    queue: int,
    http2: bool,
) -> dict[str, Any]:
    """An upstream cluster on the hosts of a mesh target (on `port` if given, else each
    host's own), balanced by least requests, health-checked, with outlier detection and
    circuit breakers sized by replica from the breaker and admission settings; over the
    mesh's mutual TLS to `service` when `[tls]` is set."""
    discovery, addresses = endpoints(target)
    if port is not None:
        addresses = [(host, port) for host in dict.fromkeys(host for host, _ in addresses)]
    edge = settings.edge
    replicas = len(addresses) if discovery == "STATIC" else edge.dns_replicas
    requests = requests_per_replica * replicas
    thresholds: dict[str, Any] = {
        "priority": "DEFAULT",
        "max_requests": requests,
        "max_pending_requests": max(queue, 1) * replicas,
        # Like the clients' retryThrottling: retries stay a fraction of traffic.
        "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 3},
    }
    if not http2:  # HTTP/1.1: one connection per request in flight.
        thresholds["max_connections"] = requests
    lb_endpoints = [{"endpoint": {"address": _address(host, port)}} for host, port in addresses]
    config: dict[str, Any] = {
        "name": name,
        "type": discovery,
        "connect_timeout": _seconds(edge.connect_timeout_s),
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]},
        "health_checks": [
            {
                "timeout": "1s",
                "interval": _seconds(edge.health_check_interval_s),
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                **health_check,
            }
        ],
        "outlier_detection": {
            **outlier_detection,
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "enforcing_failure_percentage": 0,
            "interval": "1s",
            "base_ejection_time": _seconds(max(settings.client.breaker.open_wait_s, 1.0)),
            "max_ejection_percent": 50,
        },
        "circuit_breakers": {"thresholds": [thresholds]},
    }
    if http2:
        config["typed_extension_protocol_options"] = _http2_cluster_options()
    if discovery == "STRICT_DNS":
        config["dns_lookup_family"] = "V4_PREFERRED"
    if settings.tls is not None and terminates_here(settings.tls):
        if edge.sds_dir is None:
            raise ValueError("the edge's mutual TLS needs edge.sds_dir (for its SDS files)")
        alpn = "h2" if http2 else "http/1.1"
        config["transport_socket"] = upstream_tls(settings.tls, edge.sds_dir, service, alpn)
    return config


# The SDS resources naming the edge's certificate and the mesh CA (upstream mutual TLS)
# and the listener's certificate (what clients outside see): files Envoy watches.
CERTIFICATE_SECRET = "edge_certificate"
CA_SECRET = "mesh_ca"
LISTENER_SECRET = "edge_listener"
SECRET = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
# What the listener offers by ALPN: HTTP/2 for gRPC (and any client that speaks it),
# HTTP/1.1 for the JSON routes, gRPC-Web and the HTTP APIs' clients that speak only that.
LISTENER_ALPN = ("h2", "http/1.1")


def _secret_file(sds_dir: Path, name: str, **resource: Any) -> dict[Path, dict[str, Any]]:
    """The SDS file for the secret `name`: its path and the document Envoy reads there."""
    return {sds_dir / f"{name}.json": {"resources": [{"@type": SECRET, "name": name, **resource}]}}


def _key_pair(cert_file: Path, key_file: Path) -> dict[str, Any]:
    return {
        "certificate_chain": {"filename": str(cert_file)},
        "private_key": {"filename": str(key_file)},
    }


def secret_documents(tls: TlsSettings, sds_dir: Path) -> dict[Path, dict[str, Any]]:
    """Path -> the SDS document Envoy reads there, for the mesh's mutual TLS. Certificates
    given inline in the config are read once; given by file-based SDS they are read again
    whenever a file moves into their directory, which is how the kubelet swaps a renewed
    Secret in (cert-manager renews long before expiry) and how `aimesh up --tls` may rotate."""
    trusted = {"trusted_ca": {"filename": str(tls.ca_file)}}
    return {
        **_secret_file(
            sds_dir, CERTIFICATE_SECRET, tls_certificate=_key_pair(tls.cert_file, tls.key_file)
        ),
        **_secret_file(sds_dir, CA_SECRET, validation_context=trusted),
    }


def sds_documents(settings: MeshSettings) -> dict[Path, dict[str, Any]]:
    """Every SDS file bootstrap(settings) names, by path (none without TLS): the mesh's
    mutual TLS (secret_documents) and the listener's certificate, each read again as
    secret_documents says."""
    documents: dict[Path, dict[str, Any]] = {}
    sds_dir = settings.edge.sds_dir
    if sds_dir is None:
        return documents
    if settings.tls is not None and terminates_here(settings.tls):
        documents.update(secret_documents(settings.tls, sds_dir))
    if settings.edge.tls is not None:
        pair = _key_pair(settings.edge.tls.cert_file, settings.edge.tls.key_file)
        documents.update(_secret_file(sds_dir, LISTENER_SECRET, tls_certificate=pair))
    return documents


def _sds(name: str, sds_dir: Path, watched: Path) -> dict[str, Any]:
    """A secret read from the SDS file `name` in sds_dir, and again when a file moves into
    `watched` (the directory of the files it names)."""
    return {
        "name": name,
        "sds_config": {
            "path_config_source": {
                "path": str(sds_dir / f"{name}.json"),
                "watched_directory": {"path": str(watched)},
            },
            "resource_api_version": "V3",
        },
    }


def listener_tls(tls: EdgeTlsSettings, sds_dir: Path) -> dict[str, Any]:
    """The listener's TLS for clients outside: the certificate by SDS (renewed files are
    served without a restart), ALPN h2 and http/1.1 (the connection manager's AUTO codec
    follows what was negotiated), TLS 1.2 at least. No client certificate is asked for:
    clients outside prove themselves by API key, which TLS keeps off the wire."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": _typed(
            "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            common_tls_context={
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "tls_certificate_sds_secret_configs": [
                    _sds(LISTENER_SECRET, sds_dir, tls.cert_file.parent)
                ],
                "alpn_protocols": list(LISTENER_ALPN),
            },
        ),
    }


def upstream_tls(tls: TlsSettings, sds_dir: Path, service: str, alpn: str) -> dict[str, Any]:
    """Envoy's side of the mesh's mutual TLS to `service`: the edge's own certificate
    (its identity `edge`, mesh/authz.py), and the server's checked against the mesh CA and
    its identity URI, so a listener on the port that is not that service is refused. Both
    by SDS from files (secret_documents), so renewed certificates are used without a
    restart."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": _typed(
            "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            common_tls_context={
                "tls_certificate_sds_secret_configs": [
                    _sds(CERTIFICATE_SECRET, sds_dir, tls.cert_file.parent)
                ],
                "combined_validation_context": {
                    "default_validation_context": {
                        "match_typed_subject_alt_names": [
                            {"san_type": "URI", "matcher": {"exact": identity_uri(service)}}
                        ],
                    },
                    "validation_context_sds_secret_config": _sds(
                        CA_SECRET, sds_dir, tls.ca_file.parent
                    ),
                },
                "alpn_protocols": [alpn],
            },
        ),
    }


def cluster(upstream: Upstream, settings: MeshSettings) -> dict[str, Any]:
    """`upstream`'s gRPC cluster, health-checked on its readiness name."""
    return _cluster(
        upstream.name,
        upstream.name,
        upstream.target,
        None,
        settings,
        health_check={"grpc_health_check": {"service_name": upstream.name}},
        # Envoy reads gRPC statuses as HTTP codes here: UNAVAILABLE (503) and
        # DEADLINE_EXCEEDED (504) are gateway failures and eject a replica; INTERNAL (500)
        # answers one request's content, not a replica's health, so the 5xx-based
        # detectors (on by default) are off, as in the in-process breaker.
        outlier_detection={
            "consecutive_gateway_failure": max(2, settings.client.breaker.minimum_calls // 2),
            "enforcing_consecutive_gateway_failure": 100,
        },
        requests_per_replica=upstream.requests_per_replica,
        queue=settings.service(upstream.name).max_queue,
        http2=True,
    )


def http_cluster(upstream: Upstream, settings: MeshSettings) -> dict[str, Any]:
    """`upstream`'s HTTP API: the hosts of its gRPC target on the HTTP port, spoken to in
    HTTP/1.1 (what uvicorn serves), health-checked on its own readiness path."""
    if upstream.http is None:
        raise ValueError(f"{upstream.name} serves no HTTP API")
    return _cluster(
        upstream.http_cluster,
        upstream.name,
        upstream.target,
        upstream.http.port,
        settings,
        health_check={"http_health_check": {"path": "/health/ready"}},
        # Its 5xx answers relay the mesh behind it (a 503 when generation is down, a 504
        # past a deadline): every replica would answer the same, so they eject none. Only
        # failures of the replica itself do: refused or reset connections, timeouts.
        outlier_detection={
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": max(2, settings.client.breaker.minimum_calls // 2),
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_local_origin_success_rate": 0,
            "enforcing_consecutive_gateway_failure": 0,
        },
        requests_per_replica=upstream.requests_per_replica,
        queue=settings.service(upstream.name).max_queue,
        http2=False,
    )


def _access_log() -> list[dict[str, Any]]:
    fields = {
        "time": "%START_TIME%",
        "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
        "grpc_path": "%REQ(:PATH)%",
        "http_status": "%RESPONSE_CODE%",
        "grpc_status": "%GRPC_STATUS_NUMBER%",
        "duration_ms": "%DURATION%",
        "upstream": "%UPSTREAM_HOST%",
        "flags": "%RESPONSE_FLAGS%",
        "client": "%REQ(X-AIMESH-CLIENT)%",
        "user_agent": "%REQ(USER-AGENT)%",
        # Who Envoy believes sent the request: the socket's peer, x-forwarded-for only as
        # far as edge.trusted_hops allow.
        "remote": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%",
        # HTTP/2 or HTTP/1.1 (what ALPN settled on over TLS), and the TLS version: none
        # for a plaintext listener.
        "protocol": "%PROTOCOL%",
        "tls": "%DOWNSTREAM_TLS_VERSION%",
        "request_id": "%REQ(X-REQUEST-ID)%",
        "trace_id": "%TRACE_ID%",
    }
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": _typed(
                "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                log_format={"json_format": fields},
            ),
        }
    ]


def _http_filters(
    upstreams: list[Upstream], settings: MeshSettings, descriptors: bytes
) -> list[dict[str, Any]]:
    edge = settings.edge
    max_body = settings.transport.max_message_bytes
    # The JSON body the transcoder holds while converting it: no more than any route takes.
    max_json = max([edge.max_request_bytes, *edge.route_max_request_bytes.values()])
    every_request = {"numerator": 100, "denominator": "HUNDRED"}
    enabled = {"runtime_key": "edge_rate_limit.enabled", "default_value": every_request}
    enforced = {"runtime_key": "edge_rate_limit.enforced", "default_value": every_request}
    services = [s.full_name for upstream in upstreams for s in upstream.services]
    transcoder = {
        "name": TRANSCODER,
        "typed_config": _typed(
            "envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
            proto_descriptor_bin=base64.b64encode(descriptors).decode(),
            services=services,
            print_options={"always_print_primitive_fields": True},
            convert_grpc_status=True,
            request_validation_options={
                "reject_unknown_method": True,
                "reject_unknown_query_parameters": True,
            },
            max_request_body_size=min(max_json, max_body),
            max_response_body_size=max_body,
        ),
    }
    return [
        # Before auth: load balancers and kubelet probe /healthz without a key.
        {
            "name": "envoy.filters.http.health_check",
            "typed_config": _typed(
                "envoy.extensions.filters.http.health_check.v3.HealthCheck",
                pass_through_mode=False,
                headers=[{"name": ":path", "string_match": {"exact": "/healthz"}}],
            ),
        },
        # Before auth too: browsers send CORS preflights without credentials.
        {
            "name": "envoy.filters.http.cors",
            "typed_config": _typed("envoy.extensions.filters.http.cors.v3.Cors"),
        },
        {
            "name": "envoy.filters.http.grpc_web",
            "typed_config": _typed("envoy.extensions.filters.http.grpc_web.v3.GrpcWeb"),
        },
        {
            "name": "envoy.filters.http.local_ratelimit",
            "typed_config": _typed(
                "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                stat_prefix="edge_rate_limit",
                token_bucket={
                    "max_tokens": edge.rate_limit_burst,
                    "tokens_per_fill": edge.rate_limit_per_s,
                    "fill_interval": "1s",
                },
                filter_enabled=enabled,
                filter_enforced=enforced,
                rate_limited_as_resource_exhausted=True,
            ),
        },
        # Only with gRPC services to transcode: a mesh fronted for its HTTP API alone has none.
        *([transcoder] if services else []),
        # After the transcoder, so a JSON request is checked as the gRPC method it became;
        # before the buffer, so nothing is held for a caller without a key.
        _ext_authz(settings),
        # After the transcoder, which turns a JSON request into its gRPC route's; each route
        # sets its own limit (body_limit, NO_BODY_LIMIT).
        {
            "name": BUFFER,
            "typed_config": _typed(
                "envoy.extensions.filters.http.buffer.v3.Buffer",
                max_request_bytes=edge.max_request_bytes,
            ),
        },
        {
            "name": "envoy.filters.http.grpc_stats",
            "typed_config": _typed(
                "envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
                stats_for_all_methods=True,
                enable_upstream_stats=True,
            ),
        },
        ROUTER,
    ]


def _ext_authz(settings: MeshSettings) -> dict[str, Any]:
    """The key check (mesh/edge/authorizer.py): Envoy asks the authorizer beside it with
    the key headers only, and copies the tenant and scopes it answers onto the request.
    An authorizer that does not answer fails the request closed (503)."""

    def exactly(names: tuple[str, ...]) -> dict[str, Any]:
        return {"patterns": [{"exact": name} for name in names]}

    return {
        "name": EXT_AUTHZ,
        "typed_config": _typed(
            "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            http_service={
                "server_uri": {
                    "uri": f"http://127.0.0.1:{settings.edge.authorizer_port}",
                    "cluster": AUTHORIZER_CLUSTER,
                    "timeout": "1s",
                },
                "path_prefix": authorizer.PATH_PREFIX,
                "authorization_response": {
                    "allowed_upstream_headers": exactly(authorizer.UPSTREAM_HEADERS),
                },
            },
            allowed_headers=exactly(authorizer.KEY_HEADERS),
            failure_mode_allow=False,
            status_on_error={"code": "ServiceUnavailable"},
        ),
    }


def _cors_policy(origins: list[str]) -> dict[str, Any]:
    matchers = [
        {"safe_regex": {"regex": ".*"}} if origin == "*" else {"exact": origin}
        for origin in origins
    ]
    return _typed(
        "envoy.extensions.filters.http.cors.v3.CorsPolicy",
        allow_origin_string_match=matchers,
        allow_methods="GET,POST,OPTIONS",
        allow_headers=CORS_ALLOW_HEADERS,
        expose_headers=CORS_EXPOSE_HEADERS,
        max_age="86400",
    )


def _tracing(endpoint: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The HCM tracing block and the collector cluster it exports to over OTLP/gRPC."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    collector = _static_cluster(
        COLLECTOR_CLUSTER, parts.hostname or "127.0.0.1", parts.port or 4317, http2=True
    )
    if not targets.is_ip(parts.hostname or ""):
        collector["type"] = "STRICT_DNS"
    tracing = {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": _typed(
                "envoy.config.trace.v3.OpenTelemetryConfig",
                grpc_service={"envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER}, "timeout": "1s"},
                service_name=EDGE_SERVICE_NAME,
            ),
        },
        "random_sampling": {"value": 100},
    }
    return tracing, collector


def _listener(
    name: str,
    host: str,
    port: int,
    manager: dict[str, Any],
    transport_socket: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One listener whose only filter is the given HTTP connection manager, over
    `transport_socket` (TLS) if given, else in plaintext."""
    chain: dict[str, Any] = {
        "filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
        ]
    }
    if transport_socket is not None:
        chain["transport_socket"] = transport_socket
    return {"name": name, "address": _address(host, port), "filter_chains": [chain]}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def client_transport(settings: MeshSettings) -> dict[str, Any] | None:
    """The edge listener's TLS ([edge.tls]), or None for plaintext: on a loopback host, or
    where the operator says a proxy in front ends the clients' TLS (edge.tls_ends_in_front).
    Anywhere else a plaintext listener would carry API keys across a network in clear
    text, so it is refused."""
    edge = settings.edge
    if edge.tls is None:
        if not (_is_loopback(edge.host) or edge.tls_ends_in_front):
            raise ValueError(
                f"edge.host {edge.host} is beyond loopback and the listener would be "
                "plaintext: set [edge.tls] cert_file and key_file, or edge.tls_ends_in_front "
                "= true if a proxy in front ends the clients' TLS"
            )
        return None
    if edge.sds_dir is None:
        raise ValueError("the edge listener's TLS needs edge.sds_dir (for its SDS file)")
    return listener_tls(edge.tls, edge.sds_dir)


def _metrics_listener(host: str, port: int) -> dict[str, Any]:
    """Prometheus scrapes Envoy here; the admin API itself never leaves loopback."""
    scrape = {"match": {"path": "/stats/prometheus"}, "route": {"cluster": ADMIN_CLUSTER}}
    manager = _typed(
        HTTP_CONNECTION_MANAGER,
        stat_prefix="metrics",
        route_config={"virtual_hosts": [{"name": "metrics", "domains": ["*"], "routes": [scrape]}]},
        http_filters=[ROUTER],
    )
    return _listener("metrics", host, port, manager)


def _overload_manager(settings: MeshSettings) -> dict[str, Any]:
    """Past 95% of its heap Envoy gives memory back; past 98% it takes no new requests;
    past max_connections it accepts no more connections (the edge guide's settings)."""
    heap = "envoy.resource_monitors.fixed_heap"

    def past(share: float) -> list[dict[str, Any]]:
        return [{"name": heap, "threshold": {"value": share}}]

    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {
                "name": heap,
                "typed_config": _typed(
                    "envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    max_heap_size_bytes=settings.edge.max_heap_bytes,
                ),
            },
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": _typed(
                    "envoy.extensions.resource_monitors.downstream_connections.v3."
                    "DownstreamConnectionsConfig",
                    max_active_downstream_connections=settings.edge.max_connections,
                ),
            },
        ],
        "actions": [
            {"name": "envoy.overload_actions.shrink_heap", "triggers": past(0.95)},
            {"name": "envoy.overload_actions.stop_accepting_requests", "triggers": past(0.98)},
        ],
    }


def bootstrap(
    upstreams: list[Upstream], settings: MeshSettings, *, otlp_endpoint: str | None = None
) -> dict[str, Any]:
    """The whole Envoy config; `otlp_endpoint` turns on edge spans exported there."""
    if not upstreams:
        raise ValueError(
            "no service declares edge_services or serves an HTTP API: nothing to put behind "
            "the edge"
        )
    edge = settings.edge
    every_service = [s for upstream in upstreams for s in upstream.services]
    # google.rpc.Status and its details too, so the transcoder can turn an error's
    # grpc-status-details-bin into a JSON body with the field violations.
    descriptors = api.descriptor_set(
        [*(s.file for s in every_service), status_pb2.DESCRIPTOR, error_details_pb2.DESCRIPTOR]
    )
    routes = [
        route(method, upstream.name, settings)
        for upstream in upstreams
        for method in api.methods(upstream.services)
    ]
    routes += [r for upstream in upstreams for r in http_routes(upstream, settings)]
    routes.append(NOT_ROUTED)
    manager: dict[str, Any] = _typed(
        HTTP_CONNECTION_MANAGER,
        stat_prefix="edge",
        codec_type="AUTO",
        generate_request_id=True,
        # The client is the connection's peer, never what its x-forwarded-for claims;
        # only `trusted_hops` proxies in front of Envoy add entries that are believed.
        use_remote_address=True,
        xff_num_trusted_hops=edge.trusted_hops,
        # No internal_address_config: since Envoy 1.36 no client address is "internal"
        # by default, so x-envoy-* headers from outside (retries, timeouts) are stripped
        # for loopback and private addresses too (tests/edge/test_hardening.py).
        request_headers_timeout=_seconds(edge.request_headers_timeout_s),
        # Who a request is for is the authorizer's to say, never the client's.
        early_header_mutation_extensions=[
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": _typed(
                    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    mutations=[{"remove": name} for name in authorizer.UPSTREAM_HEADERS],
                ),
            }
        ],
        common_http_protocol_options={
            "idle_timeout": _seconds(edge.idle_timeout_s),
            "headers_with_underscores_action": "REJECT_REQUEST",
        },
        http2_protocol_options={
            "max_concurrent_streams": edge.http2_max_concurrent_streams,
            "initial_stream_window_size": HTTP2_STREAM_WINDOW_BYTES,
            "initial_connection_window_size": HTTP2_CONNECTION_WINDOW_BYTES,
        },
        access_log=_access_log(),
        route_config={
            "name": "edge",
            "virtual_hosts": [
                {
                    "name": "aimesh",
                    "domains": ["*"],
                    "routes": routes,
                    "typed_per_filter_config": {
                        "envoy.filters.http.cors": _cors_policy(edge.cors_allow_origins)
                    },
                }
            ],
        },
        http_filters=_http_filters(upstreams, settings, descriptors),
    )
    clusters = [cluster(upstream, settings) for upstream in upstreams if upstream.services]
    clusters += [http_cluster(upstream, settings) for upstream in upstreams if upstream.http]
    clusters.append(_static_cluster(ADMIN_CLUSTER, "127.0.0.1", edge.admin_port, http2=False))
    clusters.append(
        _static_cluster(AUTHORIZER_CLUSTER, "127.0.0.1", edge.authorizer_port, http2=False)
    )
    if otlp_endpoint:
        manager["tracing"], collector = _tracing(otlp_endpoint)
        clusters.append(collector)
    listener = _listener("edge", edge.host, edge.port, manager, client_transport(settings))
    listener["per_connection_buffer_limit_bytes"] = BUFFER_LIMIT_BYTES
    listeners = [listener]
    if edge.metrics_port:
        listeners.append(_metrics_listener(edge.metrics_host, edge.metrics_port))
    return {
        "node": {"id": "aimesh-edge", "cluster": "aimesh-edge"},
        "admin": {"address": _address("127.0.0.1", edge.admin_port)},
        "overload_manager": _overload_manager(settings),
        # Spans reach the collector within a second instead of Envoy's default five.
        "layered_runtime": {
            "layers": [
                {
                    "name": "static",
                    "static_layer": {"tracing.opentelemetry.flush_interval_ms": 1000},
                }
            ]
        },
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
