"""The Kubernetes manifests render with kustomize, pass strict schema validation, and
probe the services the way the mesh's health contract says."""

from __future__ import annotations

import subprocess
import tomllib

import pytest
import yaml

from mesh.config import MeshSettings
from tests.conftest import ROOT, VENV_BIN

BASE = ROOT / "k8s" / "base"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    output = subprocess.run(
        [str(VENV_BIN / "kubectl"), "kustomize", str(BASE)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    path.write_text(output)
    validation = subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", str(path)],
        capture_output=True,
        text=True,
    )
    assert validation.returncode == 0, validation.stdout + validation.stderr
    return [doc for doc in yaml.safe_load_all(output) if doc]


def test_every_deployment_probes_liveness_and_readiness_over_grpc(rendered):
    deployments = [d for d in rendered if d["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert container["livenessProbe"]["grpc"].get("service", "") == ""
        assert container["readinessProbe"]["grpc"]["service"] == name
        assert container["startupProbe"]["grpc"]["service"] == name
        assert deployment["spec"]["replicas"] >= 2


def test_grace_period_covers_prestop_and_drain(rendered):
    config = tomllib.loads((BASE / "aimesh.toml").read_text())
    for deployment in (d for d in rendered if d["kind"] == "Deployment"):
        name = deployment["metadata"]["name"]
        spec = deployment["spec"]["template"]["spec"]
        pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = config["services"][name]["grace_s"]
        assert spec["terminationGracePeriodSeconds"] > pre_stop + drain


def test_services_are_headless_for_client_side_balancing(rendered):
    for service in (s for s in rendered if s["kind"] == "Service"):
        assert service["spec"]["clusterIP"] == "None"


def test_mounted_config_is_valid_mesh_settings(monkeypatch):
    monkeypatch.setenv("AIMESH_CONFIG", str(BASE / "aimesh.toml"))
    settings = MeshSettings()
    assert settings.transport.max_connection_age_s == 300
    assert settings.target_of("echo", 50100).startswith("dns:///")
