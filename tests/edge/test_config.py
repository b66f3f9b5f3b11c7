"""The generated Envoy config: valid for the real binary, and derived from the protos and
the mesh settings the way the in-process clients are."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
from google.api import annotations_pb2
from pydantic import SecretStr

from mesh.config import MeshSettings, ServiceSettings
from mesh.edge import api, authorizer, envoy
from mesh.registry import discover
from tests.conftest import ROOT, VENV_BIN, free_port, subprocess_env

pytestmark = pytest.mark.unit


@pytest.fixture
def settings() -> MeshSettings:
    settings = MeshSettings()
    settings.edge.api_keys = [SecretStr("k")]
    return settings


def assert_envoy_accepts(path: Path) -> None:
    result = subprocess.run(
        [str(VENV_BIN / "envoy"), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]


# What HTTP/2 carries for a gRPC call: /package.Service/Method.
GRPC_PATH = re.compile(r"/\w+(?:\.\w+)+/\w+")
# The gateway's OpenAI-compatible API, as the `openai` SDK calls it, and the rerank path
# Cohere, Jina and vLLM share, the ledger, and MCP's endpoint.
OPENAI_MATCHES = [
    {"path": "/v1/chat/completions"},
    {"path": "/v1/completions"},
    {"path": "/v1/responses"},
    {"path": "/v1/embeddings"},
    {"path": "/v1/images/generations"},
    {"path": "/v1/models"},
    {"prefix": "/v1/models/"},
    {"path": "/v1/rerank"},
    {"path": "/v1/usage"},
    {"path": "/mcp"},
]


def manager_of(config: dict) -> dict:
    (listener, *_) = config["static_resources"]["listeners"]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def all_routes_of(config: dict) -> list[dict]:
    (host,) = manager_of(config)["route_config"]["virtual_hosts"]
    return host["routes"]


def routes_of(config: dict) -> dict[str, dict]:
    """The gRPC routes (JSON reaches them through the transcoder), by method path."""
    return {
        route["match"]["path"]: route["route"]
        for route in all_routes_of(config)
        if GRPC_PATH.fullmatch(route["match"].get("path", ""))
    }


def http_routes_of(config: dict) -> list[dict]:
    """Every other route to a service: the OpenAI-compatible paths to the gateway's HTTP API
    (not the last one, which answers 404 to whatever no route takes)."""
    return [
        r
        for r in all_routes_of(config)
        if "route" in r and not GRPC_PATH.fullmatch(r["match"].get("path", ""))
    ]


def clusters_of(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def endpoints_of(cluster: dict) -> list[tuple[str, int]]:
    (group,) = cluster["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in group["lb_endpoints"]]
    return [(a["address"], a["port_value"]) for a in addresses]


def disabled_filters(route: dict) -> set[str]:
    configs = route.get("typed_per_filter_config", {})
    return {name for name, config in configs.items() if config.get("disabled")}


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


def edge_config(settings: MeshSettings, *names: str) -> dict:
    """The config for these services (`aimesh up --only ... --edge`); all when none named."""
    specs = [discover()[name] for name in names] or list(discover().values())
    return envoy.bootstrap(envoy.upstreams_for(specs, settings), settings)


def test_the_real_envoy_accepts_the_config(settings, tmp_path):
    config = envoy.bootstrap(
        envoy.upstreams_for(list(discover().values()), settings),
        settings,
        otlp_endpoint="http://collector.example.test:4317",
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(json.dumps(config))
    assert_envoy_accepts(path)


def test_only_edge_services_are_routed(settings):
    routes = routes_of(
        envoy.bootstrap(envoy.upstreams_for(list(discover().values()), settings), settings)
    )
    services = {path.split("/")[1] for path in routes}
    exposed = {name for spec in discover().values() for name in spec.edge_services}
    assert services == exposed
    for internal in ("DecodeService", "PrefillService", "KvCacheService", "TokenizerService",
                     "EchoService", "ServerReflection", "Health"):  # fmt: skip
        assert not any(internal in path for path in routes)
    # Besides gRPC methods, only OpenAI's paths, to the gateway's HTTP API.
    others = http_routes_of(
        envoy.bootstrap(envoy.upstreams_for(list(discover().values()), settings), settings)
    )
    assert [route["match"] for route in others] == OPENAI_MATCHES
    assert {route["route"]["cluster"] for route in others} == {"gateway-http"}


def test_timeouts_and_retries_follow_the_protos_and_client_settings(settings):
    settings.client.method_deadlines_s["/aimesh.retrieval.v1.RetrievalService/Search"] = 3.0
    routes = routes_of(
        envoy.bootstrap(envoy.upstreams_for(list(discover().values()), settings), settings)
    )
    generate = routes["/aimesh.llm.v1.GenerationService/Generate"]
    embed = routes["/aimesh.retrieval.v1.EmbedderService/Embed"]
    search = routes["/aimesh.retrieval.v1.RetrievalService/Search"]
    upsert = routes["/aimesh.retrieval.v1.RetrievalService/Upsert"]
    assert all(route["timeout"] == "0s" for route in routes.values())
    assert generate["max_stream_duration"]["max_stream_duration"] == "300.000s"
    assert embed["max_stream_duration"]["max_stream_duration"] == "10.000s"
    assert search["max_stream_duration"]["max_stream_duration"] == "3.000s"
    assert embed["max_stream_duration"]["grpc_timeout_header_max"] == "300.000s"
    # Retried on UNAVAILABLE only where the proto says it is safe.
    assert "unavailable" in embed["retry_policy"]["retry_on"]
    assert "unavailable" in search["retry_policy"]["retry_on"]
    assert "unavailable" not in generate["retry_policy"]["retry_on"]
    assert "unavailable" not in upsert["retry_policy"]["retry_on"]
    assert embed["retry_policy"]["num_retries"] == settings.client.retry_max_attempts - 1


def test_breakers_and_ejection_match_the_mesh_settings(settings):
    settings.services["embedder"] = ServiceSettings(
        target="ipv4:127.0.0.1:7001,127.0.0.1:7002", max_concurrency=3, max_queue=5
    )
    specs = [discover()["embedder"]]
    (cluster,) = [
        c
        for c in envoy.bootstrap(envoy.upstreams_for(specs, settings), settings)[
            "static_resources"
        ]["clusters"]
        if c["name"] == "embedder"
    ]
    assert cluster["type"] == "STATIC"
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == (3 + 5) * 2
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == "embedder"
    outlier = cluster["outlier_detection"]
    assert outlier["base_ejection_time"] == f"{settings.client.breaker.open_wait_s:.3f}s"
    # Only gateway failures eject a replica: one request's INTERNAL is not its health.
    assert outlier["enforcing_consecutive_gateway_failure"] == 100
    assert outlier["enforcing_consecutive_5xx"] == 0
    assert outlier["enforcing_success_rate"] == outlier["enforcing_failure_percentage"] == 0


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("dns:///decode.aimesh.svc:50063", ("STRICT_DNS", [("decode.aimesh.svc", 50063)])),
        ("ipv4:127.0.0.1:1,127.0.0.1:2", ("STATIC", [("127.0.0.1", 1), ("127.0.0.1", 2)])),
        ("127.0.0.1:50070", ("STATIC", [("127.0.0.1", 50070)])),
        ("embedder:50070", ("STRICT_DNS", [("embedder", 50070)])),
        ("[::1]:50070", ("STATIC", [("::1", 50070)])),
    ],
)
def test_grpc_targets_become_envoy_endpoints(target, expected):
    assert envoy.endpoints(target) == expected


@pytest.mark.parametrize("target", ["no-port", "host:", "dns:///host:http"])
def test_a_target_without_a_port_is_refused(target):
    with pytest.raises(ValueError, match="host:port"):
        envoy.endpoints(target)


def test_no_keys_no_edge(settings):
    """An edge nobody can pass is a mistake: its authorizer refuses to start without keys,
    and the rendered config holds none (the authorizer has them)."""
    config = json.dumps(
        envoy.bootstrap(envoy.upstreams_for(list(discover().values()), settings), settings)
    )
    assert "api_key_auth" not in config and '"k"' not in config
    settings.edge.api_keys = []
    with pytest.raises(ValueError, match="API key"):
        authorizer.Keys(settings)


def test_tracing_only_when_a_collector_is_named(settings):
    upstreams = envoy.upstreams_for(list(discover().values()), settings)
    quiet = envoy.bootstrap(upstreams, settings)
    traced = envoy.bootstrap(upstreams, settings, otlp_endpoint="http://127.0.0.1:4317")
    manager = traced["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert manager["typed_config"]["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    assert "tracing" not in json.dumps(quiet["static_resources"]["listeners"][0])


def test_openai_paths_go_to_the_gateways_http_port_untranscoded(settings):
    config = edge_config(settings)
    budget_s = discover()["gateway"].load_options()().request_timeout_s
    routes = http_routes_of(config)
    assert [route["match"] for route in routes] == OPENAI_MATCHES
    for route in routes:
        action = route["route"]
        assert action["cluster"] == "gateway-http"
        # The transcoder never sees them; the gateway has no key file by default, so the
        # edge's own key check stays on.
        assert disabled_filters(route) == {envoy.TRANSCODER}
        # Server-sent events: no response timeout, and neither the idle timeout nor the
        # stream's cap cuts a request before the gateway's own budget does.
        assert action["timeout"] == "0s"
        assert seconds(action["idle_timeout"]) > budget_s
        assert seconds(action["max_stream_duration"]["max_stream_duration"]) > budget_s
        # A completion is no idempotent call: retried only when it never left Envoy.
        assert action["retry_policy"]["retry_on"] == envoy.NEVER_SENT
    # Nothing holds a response back until it ends: the buffer filter holds requests only.
    filters = {f["name"]: f["typed_config"] for f in manager_of(config)["http_filters"]}
    assert not [name for name in filters if "compressor" in name]
    assert set(filters[envoy.BUFFER]) == {"@type", "max_request_bytes"}
    clusters = clusters_of(config)
    http = clusters["gateway-http"]
    assert endpoints_of(http) == [("127.0.0.1", 8000)]
    # HTTP/1.1, what uvicorn speaks; health from the gateway's own readiness path.
    assert "typed_extension_protocol_options" not in http
    assert http["health_checks"][0]["http_health_check"] == {"path": "/health/ready"}
    # Its 5xx relay the mesh behind it: only a replica's own failures eject it.
    outlier = http["outlier_detection"]
    assert outlier["split_external_local_origin_errors"] is True
    assert outlier["enforcing_consecutive_local_origin_failure"] == 100
    assert outlier["enforcing_consecutive_5xx"] == 0
    assert outlier["enforcing_consecutive_gateway_failure"] == 0
    # The gateway's gRPC port answers health and GetInfo only: nothing routes there.
    assert "gateway" not in clusters


def test_the_transcoders_json_routes_stay_with_the_transcoder(settings):
    """The JSON routes share /v1/ with OpenAI's paths (/v1/chat beside /v1/chat/
    completions): none of them may match a route to the gateway, which the transcoder
    would then skip."""
    openai = [route["match"] for route in http_routes_of(edge_config(settings))]
    names = [name for spec in discover().values() for name in spec.edge_services]
    paths = []
    for service in api.load_services(names):
        for method in service.methods:
            rule = method.GetOptions().Extensions[annotations_pb2.http]
            pattern = rule.WhichOneof("pattern")
            if pattern:
                paths.append(re.sub(r"\{(\w+)[^}]*\}", r"\1", getattr(rule, pattern)))
    assert "/v1/chat" in paths and len(paths) >= 10
    for path in paths:
        for match in openai:
            assert path != match.get("path") and not path.startswith(match.get("prefix", "~"))


def test_a_gateway_that_checks_keys_gets_the_authorization_header(settings, tmp_path):
    """With its own key file the gateway is the authority on its paths: the edge's check,
    which would refuse an OpenAI key and hide the header, is off there only."""
    settings.services["gateway"] = ServiceSettings(api_keys_file=str(tmp_path / "keys.json"))
    config = edge_config(settings)
    for route in http_routes_of(config):
        assert disabled_filters(route) == {envoy.TRANSCODER, envoy.EXT_AUTHZ}
    assert routes_of(config)
    for route in all_routes_of(config):
        if route not in http_routes_of(config):
            assert not disabled_filters(route) - {envoy.BUFFER}, route["match"]
    path = tmp_path / "envoy.yaml"
    path.write_text(json.dumps(config))
    assert_envoy_accepts(path)


def test_openai_paths_only_when_the_gateway_runs(settings):
    without = edge_config(settings, "generation", "embedder")
    assert not http_routes_of(without)
    assert not [name for name in clusters_of(without) if name.endswith("-http")]
    alone = edge_config(settings, "gateway")
    assert not routes_of(alone)
    assert [route["match"] for route in http_routes_of(alone)] == OPENAI_MATCHES
    # No gRPC service to transcode: no transcoder at all, and the real Envoy agrees.
    filters = [f["name"] for f in manager_of(alone)["http_filters"]]
    assert envoy.TRANSCODER not in filters and envoy.EXT_AUTHZ in filters


def test_the_real_envoy_accepts_the_gateway_alone(settings, tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(json.dumps(edge_config(settings, "gateway")))
    assert_envoy_accepts(path)


def test_gateway_replicas_are_reached_on_their_http_port(settings):
    settings.services["gateway"] = ServiceSettings(
        target="ipv4:127.0.0.1:7001,127.0.0.2:7002", http_port=9000, max_queue=4
    )
    (http,) = [c for c in edge_config(settings, "gateway")["static_resources"]["clusters"]
               if c["name"] == "gateway-http"]  # fmt: skip
    assert http["type"] == "STATIC"
    assert endpoints_of(http) == [("127.0.0.1", 9000), ("127.0.0.2", 9000)]
    (thresholds,) = http["circuit_breakers"]["thresholds"]
    slots = discover()["gateway"].max_concurrency
    # HTTP/1.1: a connection per request in flight.
    assert thresholds["max_requests"] == thresholds["max_connections"] == (slots + 4) * 2


def test_the_edge_needs_the_gateways_http_port_fixed(settings):
    settings.services["gateway"] = ServiceSettings(http_port=0)
    with pytest.raises(ValueError, match="http_port"):
        edge_config(settings)


def test_the_kubernetes_edge_config_validates(tmp_path):
    """What the edge pod's init container renders from k8s/base/aimesh.toml."""
    config = tmp_path / "envoy.yaml"
    result = subprocess.run(
        [str(VENV_BIN / "aimesh"), "edge", "render", "--out", str(config)],
        env=subprocess_env(
            AIMESH_CONFIG=str(ROOT / "k8s" / "base" / "aimesh.toml"),
            AIMESH_EDGE__HOST="0.0.0.0",
            AIMESH_EDGE__TLS_ENDS_IN_FRONT="true",  # k8s/base/edge.yaml's choice
            AIMESH_EDGE__API_KEYS='["a-key"]',
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT="http://otel-collector.aimesh.svc.cluster.local:4317",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    rendered = json.loads(config.read_text())
    clusters = {c["name"]: c for c in rendered["static_resources"]["clusters"]}
    assert clusters["generation"]["type"] == "STRICT_DNS"
    address = clusters["generation"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"]["address"].endswith(
        ".svc.cluster.local"
    )
    assert clusters["otel_collector"]["type"] == "STRICT_DNS"
    assert clusters["gateway-http"]["type"] == "STRICT_DNS"
    assert endpoints_of(clusters["gateway-http"]) == [("gateway.aimesh.svc.cluster.local", 8000)]
    assert_envoy_accepts(config)


def test_two_services_claiming_one_http_path_are_refused(settings):
    gateway = discover()["gateway"]
    twin = dataclasses.replace(gateway, name="gateway-twin", default_port=50121)
    with pytest.raises(ValueError, match="both claim /v1/chat/completions"):
        envoy.upstreams_for([gateway, twin], settings)


def test_with_tls_envoy_reaches_each_service_over_mutual_tls_as_the_edge(settings, tmp_path):
    """`aimesh up --tls --edge`: every cluster, gRPC and HTTP, presents the edge's
    certificate and accepts only the certificate naming the service it routes to; both
    the certificate and the CA come from SDS files that point at [tls]'s files."""
    from mesh.authz import EDGE, identity_uri
    from mesh.edge.process import write_config
    from mesh.pki import throwaway_pki

    settings.tls = throwaway_pki(tmp_path / "pki", [EDGE])[EDGE]
    settings.edge.sds_dir = tmp_path / "edge"
    config = edge_config(settings)
    upstream = {c["name"]: c for c in config["static_resources"]["clusters"]}
    local = (envoy.ADMIN_CLUSTER, envoy.AUTHORIZER_CLUSTER)  # on loopback, beside Envoy
    meshed = {name: c for name, c in upstream.items() if name not in local}
    assert {"generation", "gateway-http", "diffusion"} <= set(meshed)
    secrets = envoy.secret_documents(settings.tls, settings.edge.sds_dir)
    for name, cluster in meshed.items():
        context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
        (certificate,) = context["tls_certificate_sds_secret_configs"]
        source = certificate["sds_config"]["path_config_source"]
        assert source["watched_directory"]["path"] == str(settings.tls.cert_file.parent)
        (resource,) = secrets[Path(source["path"])]["resources"]
        assert resource["tls_certificate"]["private_key"]["filename"] == str(settings.tls.key_file)
        combined = context["combined_validation_context"]
        ca_source = combined["validation_context_sds_secret_config"]["sds_config"]
        (ca,) = secrets[Path(ca_source["path_config_source"]["path"])]["resources"]
        assert ca["validation_context"]["trusted_ca"]["filename"] == str(settings.tls.ca_file)
        service = name.removesuffix("-http")
        (san,) = combined["default_validation_context"]["match_typed_subject_alt_names"]
        assert san["matcher"] == {"exact": identity_uri(service)}
        assert context["alpn_protocols"] == (["http/1.1"] if name.endswith("-http") else ["h2"])
    assert not [name for name in local if "transport_socket" in upstream[name]]
    path = write_config(config, settings.edge.sds_dir / "envoy.json", secrets)
    assert_envoy_accepts(path)


@pytest.mark.system
async def test_envoy_reads_a_renewed_certificate_without_a_restart(settings, tmp_path):
    """The kubelet swaps a renewed Secret in by moving files into its directory; the real
    Envoy then serves the new certificate (its admin /certs), with no restart."""
    from mesh.authz import EDGE
    from mesh.edge import process
    from mesh.pki import throwaway_pki

    settings.tls = throwaway_pki(tmp_path / "pki", [EDGE])[EDGE]
    settings.edge.sds_dir = tmp_path / "edge"
    settings.edge.port, settings.edge.admin_port = free_port(), free_port()
    settings.edge.metrics_port = 0
    path = process.write_config(
        edge_config(settings),
        settings.edge.sds_dir / "envoy.json",
        envoy.secret_documents(settings.tls, settings.edge.sds_dir),
    )
    renewed = throwaway_pki(tmp_path / "renewed", [EDGE])[EDGE]
    proxy = await process.start(str(VENV_BIN / "envoy"), path, tmp_path / "envoy.log")
    try:
        await wait_for_certificate(settings, settings.tls.cert_file)
        for name in ("key_file", "cert_file"):  # moved in, as the kubelet's ..data swap
            os.replace(getattr(renewed, name), getattr(settings.tls, name))
        await wait_for_certificate(settings, settings.tls.cert_file)
        assert proxy.returncode is None
    finally:
        await process.stop(proxy)


def serial_of(cert_file: Path) -> str:
    from cryptography import x509

    return format(x509.load_pem_x509_certificate(cert_file.read_bytes()).serial_number, "x")


async def wait_for_certificate(settings, cert_file: Path, timeout_s: float = 30.0) -> None:
    """Until Envoy's admin /certs lists the serial number of the certificate in cert_file
    (Envoy starts in well under a second here; 30 s allows a loaded machine)."""
    serial = serial_of(cert_file)
    url = f"http://127.0.0.1:{settings.edge.admin_port}/certs"
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    seen = ""
    while loop.time() < give_up:
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                seen = (await client.get(url)).text
        except httpx.TransportError:
            seen = ""
        if serial.lstrip("0") in seen.replace('"', " "):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"Envoy never served certificate {serial}: {seen[-1000:]}")


def test_the_written_config_is_readable_by_its_owner_only(settings, tmp_path):
    """It holds the edge's API keys; a file already there (once 0644) is replaced."""
    from mesh.edge.process import write_config

    path = tmp_path / "edge" / "envoy.json"
    path.parent.mkdir()
    path.write_text("{}")
    path.chmod(0o644)
    write_config(edge_config(settings), path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["static_resources"]


def test_the_edge_follows_envoys_edge_guide(settings, tmp_path):
    """Envoy's "configuring Envoy as an edge proxy": the client is the socket's peer, buffers
    and HTTP/2 windows small, timeouts on headers and idle connections, an overload manager;
    bodies bounded per route, client streams per message; admin and metrics on loopback."""
    settings.edge.route_max_request_bytes = {"/aimesh.retrieval.v1.EmbedderService/Embed": 4 << 20}
    config = edge_config(settings)
    manager = manager_of(config)
    assert manager["use_remote_address"] is True and manager["xff_num_trusted_hops"] == 0
    assert "internal_address_config" not in manager  # Envoy >= 1.36: nobody is internal
    assert manager["common_http_protocol_options"]["headers_with_underscores_action"] == (
        "REJECT_REQUEST"
    )
    assert manager["http2_protocol_options"]["max_concurrent_streams"] == 100
    assert manager["http2_protocol_options"]["initial_stream_window_size"] == 65536
    assert seconds(manager["request_headers_timeout"]) == 10
    (listener, metrics) = config["static_resources"]["listeners"]
    assert listener["per_connection_buffer_limit_bytes"] == 32768
    assert metrics["address"]["socket_address"]["address"] == "127.0.0.1"
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    for cluster in clusters_of(config).values():
        if cluster["name"] not in (envoy.ADMIN_CLUSTER, envoy.AUTHORIZER_CLUSTER):
            assert cluster["per_connection_buffer_limit_bytes"] == 32768
    monitors = {m["name"] for m in config["overload_manager"]["resource_monitors"]}
    assert monitors == {
        "envoy.resource_monitors.fixed_heap",
        "envoy.resource_monitors.global_downstream_max_connections",
    }

    def limit(route: dict) -> int | None:
        buffer = route["typed_per_filter_config"][envoy.BUFFER]
        return None if buffer.get("disabled") else buffer["buffer"]["max_request_bytes"]

    by_path = {next(iter(r["match"].values())): r for r in all_routes_of(config)}
    assert by_path["/"] == envoy.NOT_ROUTED and all_routes_of(config)[-1] == envoy.NOT_ROUTED
    assert limit(by_path["/aimesh.retrieval.v1.EmbedderService/Embed"]) == 4 << 20
    assert limit(by_path["/aimesh.llm.v1.GenerationService/Generate"]) == 1 << 20
    assert limit(by_path["/v1/chat/completions"]) == 1 << 20
    assert limit(by_path["/aimesh.retrieval.v1.RetrievalService/Upsert"]) is None
    # No browser origin is allowed unless configured.
    (host,) = manager["route_config"]["virtual_hosts"]
    cors = host["typed_per_filter_config"]["envoy.filters.http.cors"]
    assert cors["allow_origin_string_match"] == []
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    assert_envoy_accepts(path)
