"""The generated Envoy config: valid for the real binary, and derived from the protos and
the mesh settings the way the in-process clients are."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pydantic import SecretStr

from mesh.config import MeshSettings, ServiceSettings
from mesh.edge import envoy
from mesh.registry import discover
from tests.conftest import ROOT, VENV_BIN, subprocess_env

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


def routes_of(config: dict) -> dict[str, dict]:
    (listener, *_) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (host,) = manager["route_config"]["virtual_hosts"]
    return {route["match"]["path"]: route["route"] for route in host["routes"]}


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
    settings.edge.api_keys = []
    with pytest.raises(ValueError, match="API key"):
        envoy.bootstrap(envoy.upstreams_for(list(discover().values()), settings), settings)


def test_tracing_only_when_a_collector_is_named(settings):
    upstreams = envoy.upstreams_for(list(discover().values()), settings)
    quiet = envoy.bootstrap(upstreams, settings)
    traced = envoy.bootstrap(upstreams, settings, otlp_endpoint="http://127.0.0.1:4317")
    manager = traced["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert manager["typed_config"]["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    assert "tracing" not in json.dumps(quiet["static_resources"]["listeners"][0])


def test_the_kubernetes_edge_config_validates(tmp_path):
    """What the edge pod's init container renders from k8s/base/aimesh.toml."""
    config = tmp_path / "envoy.yaml"
    result = subprocess.run(
        [str(VENV_BIN / "aimesh"), "edge", "render", "--out", str(config)],
        env=subprocess_env(
            AIMESH_CONFIG=str(ROOT / "k8s" / "base" / "aimesh.toml"),
            AIMESH_EDGE__HOST="0.0.0.0",
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
    assert_envoy_accepts(config)
