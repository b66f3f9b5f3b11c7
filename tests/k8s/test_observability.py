"""Scrape config, rules, dashboard, adapter rules and collector config name only what the
processes really export and what the manifests really declare."""

from __future__ import annotations

import json
import re

import grpc
import pytest
import yaml

from mesh.breaker import FAILURE_CODES
from mesh.config import MeshSettings
from mesh.registry import discover
from tests.k8s.conftest import (
    K8S,
    Doc,
    containers,
    exported_metrics,
    of_kind,
    workloads,
)

pytestmark = pytest.mark.system

OBSERVABILITY = K8S / "observability"
SPECS = discover()
# A metric name in PromQL: not part of a longer name or a recording rule's level:name:op.
METRIC = re.compile(r"(?<![\w:])aimesh_[a-z0-9_]+(?![\w:])")
RECORDED = re.compile(r"(?<![\w:])aimesh:[a-z0-9_]+:[a-z0-9_]+(?![\w:])")
DURATION = re.compile(r"^\d+[smhd]$")


def load(name: str):
    return yaml.safe_load((OBSERVABILITY / name).read_text())


def rules() -> list[Doc]:
    return [rule for group in load("aimesh-rules.yaml")["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((OBSERVABILITY / "aimesh-dashboard.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_rules_have_the_prometheus_rule_file_shape():
    document = load("aimesh-rules.yaml")
    assert set(document) == {"groups"}
    names = [group["name"] for group in document["groups"]]
    assert len(names) == len(set(names))
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert rule["expr"].strip()
            if "record" in rule:
                assert set(rule) <= {"record", "expr", "labels"}
                assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"])
            else:
                assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
                assert DURATION.match(rule["for"]), rule["alert"]
                assert rule["labels"]["severity"]
                assert rule["annotations"]["summary"]
    recorded = [r["record"] for r in rules() if "record" in r]
    assert len(recorded) == len(set(recorded))
    assert any("time_to_first_token" in r and "p99" in r for r in recorded)
    assert any("error_ratio" in r for r in recorded)
    alerts = [r["expr"] for r in rules() if "alert" in r]
    alerted = {name for expr in alerts for name in RECORDED.findall(expr)}
    assert alerted >= {"aimesh:llm_time_to_first_token_seconds:p99_rate5m"}
    assert any("error_ratio" in name for name in alerted)


def test_every_metric_in_rules_and_dashboard_is_exported():
    exported = exported_metrics()
    recorded = {r["record"] for r in rules() if "record" in r}
    exprs = [r["expr"] for r in rules()] + dashboard_exprs()
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used, "no aimesh metric found: the pattern is wrong"
    assert used - set(exported) == set()
    assert {name for expr in exprs for name in RECORDED.findall(expr)} <= recorded
    # Quantiles only over histogram buckets, rates only over counters and histograms.
    for expr in exprs:
        for name in re.findall(r"histogram_quantile\([^,]+,.*?(aimesh_\w+)", expr, re.S):
            assert name.endswith("_bucket") and exported[name] == "histogram", expr
        for name in re.findall(r"rate\((aimesh_\w+)", expr):
            assert exported[name] in ("counter", "histogram"), expr


def test_error_ratio_counts_what_breakers_count_and_every_server_bug():
    """A server-side failure for the SLO: what trips a caller's breaker, deadlines, and
    INTERNAL/UNKNOWN, which breakers leave alone (one request's bug is not the target's
    health) but which are failures of the service all the same."""
    bugs = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
    for rule in rules():
        for codes in re.findall(r'grpc_code=~"([^"]+)"', rule["expr"]):
            named = {grpc.StatusCode[code] for code in codes.split("|")}
            assert named == {*FAILURE_CODES, grpc.StatusCode.DEADLINE_EXCEEDED, *bugs}


def test_dashboard_shows_what_the_issue_asks_for():
    exprs = " ".join(dashboard_exprs())
    for needed in (
        "aimesh_llm_time_to_first_token_seconds_bucket",
        "aimesh_llm_inter_token_latency_seconds_bucket",
        "aimesh_admission_queue_depth",
        "aimesh_llm_num_requests_waiting",
        "by (grpc_code)",
        "aimesh_breaker_state",
        "aimesh_llm_kv_cache_usage_perc",
    ):
        assert needed in exprs, needed
    dashboard = json.loads((OBSERVABILITY / "aimesh-dashboard.json").read_text())
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert len(titles) == len(set(titles))
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(titles) + 1))


def test_prometheus_keeps_annotated_pods_and_labels_them_for_the_adapter():
    config = load("prometheus.yml")
    job = jobs(config)["aimesh-pods"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    relabel = job["relabel_configs"]
    keep = relabel[0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    targets = {r.get("target_label") for r in relabel}
    assert {"__metrics_path__", "__address__", "namespace", "pod"} <= targets
    # The adapter maps exactly those labels to Kubernetes objects.
    for rule in load("prometheus-adapter-values.yaml")["rules"]["custom"]:
        assert set(rule["resources"]["overrides"]) <= targets


def jobs(config: dict) -> dict[str, dict]:
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_qdrant_is_scraped_with_its_api_key_and_only_so(overlay):
    """Qdrant's /metrics answers only its key: no annotation sends it to the keyless job,
    the qdrant job reads the key from Secret aimesh-qdrant's mount and keeps Qdrant's http
    port only."""
    qdrant = of_kind(overlay, "StatefulSet")["qdrant"]
    assert "prometheus.io/scrape" not in qdrant["spec"]["template"]["metadata"].get(
        "annotations", {}
    )
    job = jobs(load("prometheus.yml"))["qdrant"]
    credentials = job["authorization"]["credentials_file"]
    assert job["authorization"]["type"] == "Bearer"
    assert credentials.endswith("/aimesh-qdrant/api-key")
    assert (
        "aimesh-qdrant" in of_kind(overlay, "Secret")
        and "api-key" in (of_kind(overlay, "Secret")["aimesh-qdrant"]["data"])
    )
    keeps = {
        tuple(r["source_labels"]): r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == "qdrant"
    port = keeps[("__meta_kubernetes_pod_container_port_name",)]
    (container,) = containers(qdrant)
    assert {"name": port, "containerPort": 6333} in container["ports"]


def test_annotated_scrape_ports_are_declared_metrics_ports(overlay, deployed, monkeypatch):
    monkeypatch.setenv("AIMESH_CONFIG", str(K8S / "base" / "aimesh.toml"))
    settings = MeshSettings()
    scraped = set()
    for name, workload in workloads(overlay).items():
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        scraped.add(name)
        port = int(annotations["prometheus.io/port"])
        declared = [p["containerPort"] for c in containers(workload) for p in c.get("ports", [])]
        assert port in declared, name
        if name in SPECS:
            assert port == settings.metrics_port_of(name, SPECS[name].default_port)
            assert annotations["prometheus.io/path"] == "/metrics"
    assert scraped >= {*deployed, "edge"}


def test_every_autoscaler_metric_is_served_by_the_adapter(overlay):
    served = {r["name"]["as"] for r in load("prometheus-adapter-values.yaml")["rules"]["custom"]}
    wanted = {
        m["pods"]["metric"]["name"]
        for hpa in of_kind(overlay, "HorizontalPodAutoscaler").values()
        for m in hpa["spec"]["metrics"]
        if m["type"] == "Pods"
    }
    assert wanted and wanted <= served


def test_collector_receives_otlp_grpc_and_http_and_batches_into_its_exporter(overlay):
    """OTLP/gRPC from the mesh's pods and the edge, OTLP/HTTP from Triton, on the standard
    ports, each a port of the collector's container and of its Service."""
    config = load("otel-collector-config.yaml")
    endpoints = {
        protocol: settings["endpoint"]
        for protocol, settings in config["receivers"]["otlp"]["protocols"].items()
    }
    assert endpoints == {"grpc": "0.0.0.0:4317", "http": "0.0.0.0:4318"}
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert "batch" in pipeline["processors"]
    assert pipeline["exporters"] and set(pipeline["exporters"]) <= set(config["exporters"])
    assert set(pipeline["processors"]) <= set(config["processors"])
    collector = of_kind(overlay, "Deployment")["otel-collector"]
    (container,) = containers(collector)
    assert container["image"].startswith("otel/opentelemetry-collector-contrib:")
    for name, port in {"otlp-grpc": 4317, "otlp-http": 4318}.items():
        assert {"name": name, "containerPort": port} in container["ports"]
    service = of_kind(overlay, "Service")["otel-collector"]
    served = {p["targetPort"]: (p["port"], p["appProtocol"]) for p in service["spec"]["ports"]}
    assert served == {"otlp-grpc": (4317, "grpc"), "otlp-http": (4318, "http")}


def test_monitoring_config_ships_as_configmaps(overlay):
    maps = of_kind(overlay, "ConfigMap")
    assert "prometheus.yml" in maps["prometheus-config"]["data"]
    assert yaml.safe_load(maps["aimesh-prometheus-rules"]["data"]["aimesh-rules.yaml"])["groups"]
    dashboard = maps["aimesh-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["aimesh-dashboard.json"])["panels"]
