"""The Envoy edge: its config rendered at pod start by `aimesh edge render` into a volume
Envoy reads, its keys from the Secret (never the placeholder), and its image and keys
replaceable from an overlay of one's own, as docs/deploy.md says; the gateway's own keys
from theirs."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import PurePosixPath

import pytest

from mesh import tracing
from mesh.config import MeshSettings, ServiceSettings
from mesh.edge import envoy
from mesh.keys import KeyFile
from mesh.registry import discover
from tests.k8s.conftest import (
    HTTP_SERVICES,
    K8S,
    NAMESPACE,
    config_toml,
    containers,
    documents,
    env_of,
    kustomize,
    of_kind,
    pod_settings,
    pod_spec,
)

pytestmark = pytest.mark.system

RENDER = "aimesh edge render --out "


def edge(docs):
    deployment = of_kind(docs, "Deployment")["edge"]
    (render,) = pod_spec(deployment)["initContainers"]
    running = {c["name"]: c for c in pod_spec(deployment)["containers"]}
    assert set(running) == {"envoy", "authorizer"}
    return deployment, render, running["envoy"]


def authorizer(docs):
    deployment = of_kind(docs, "Deployment")["edge"]
    (checker,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == "authorizer"]
    return checker


def test_envoy_reads_the_config_the_init_container_renders(overlay):
    deployment, render, envoy = edge(overlay)
    command = " ".join(render["command"])
    out = PurePosixPath(command[command.index(RENDER) + len(RENDER) :].split()[0])
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0"
    assert envoy["args"] == ["-c", str(out), "--service-node", "edge"]

    def mounted_at_out(container) -> set[str]:
        return {m["name"] for m in container["volumeMounts"] if m["mountPath"] == str(out.parent)}

    (volume,) = mounted_at_out(render) & mounted_at_out(envoy)
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert volumes[volume]["emptyDir"]["medium"] == "Memory"
    env = env_of(render)
    assert env["AIMESH_CONFIG"]["value"] == "/etc/aimesh/aimesh.toml"
    assert env["AIMESH_EDGE__HOST"]["value"] == "0.0.0.0"
    assert render["image"] == next(containers(of_kind(overlay, "Deployment")["agent"]))["image"]


def test_envoy_serves_clients_and_prometheus_and_is_probed_over_http(overlay):
    """Probed over HTTPS where the listener serves TLS (the mtls component's), else HTTP."""
    deployment, render, envoy = edge(overlay)
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert ports == {"http": 8080, "metrics": 9902}
    tls = "AIMESH_EDGE__TLS__CERT_FILE" in env_of(render)
    for probe in ("readinessProbe", "livenessProbe"):
        assert envoy[probe]["httpGet"] == {
            "path": "/healthz",
            "port": "http",
            **({"scheme": "HTTPS"} if tls else {}),
        }
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9902"
    assert annotations["prometheus.io/path"] == "/stats/prometheus"


def test_every_upstream_of_the_rendered_config_is_a_service_of_the_overlay(
    overlay, deployed, monkeypatch, tmp_path
):
    """Envoy's clusters, from the config the init container renders with its pod's settings
    and environment, each lead to a port of a Service this overlay deploys: every mesh
    service with an edge API or an HTTP API (the gateway's, on its HTTP port), and the
    collector."""
    deployment, render, _ = edge(overlay)
    settings = pod_settings(
        overlay, deployment, render, monkeypatch, tmp_path, AIMESH_EDGE__API_KEYS='["key"]'
    )
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    for name, entry in env_of(render).items():
        if name.startswith("OTEL_"):
            monkeypatch.setenv(name, entry["value"])
    config = envoy.bootstrap(
        envoy.upstreams_for(list(discover().values()), settings),
        settings,
        otlp_endpoint=tracing.otlp_endpoint(),
    )
    services = of_kind(overlay, "Service")
    reached = set()
    for cluster in config["static_resources"]["clusters"]:
        for group in cluster["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                address = endpoint["endpoint"]["address"]["socket_address"]
                host, port = address["address"], address["port_value"]
                if host == "127.0.0.1":  # Envoy's own admin interface
                    continue
                name, namespace, domain = host.split(".", 2)
                assert (namespace, domain) == (NAMESPACE, "svc.cluster.local"), host
                assert name in services, f"{cluster['name']} leads to {host}: no such Service"
                assert port in [p["port"] for p in services[name]["spec"]["ports"]], host
                reached.add(name)
    fronted = {name for name, spec in discover().items() if spec.edge_services} | HTTP_SERVICES
    assert reached == (fronted & deployed) | {"otel-collector"}
    # The OpenAI-compatible API reaches the gateway's HTTP port, not its gRPC one.
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name in HTTP_SERVICES & deployed:
        (group,) = clusters[f"{name}-http"]["load_assignment"]["endpoints"]
        ports = {
            e["endpoint"]["address"]["socket_address"]["port_value"] for e in group["lb_endpoints"]
        }
        assert ports == {settings.service(name).own()["http_port"]}, name


def test_api_keys_come_from_the_secrets_to_the_authorizer_only(overlay):
    """The clear keys of Secret aimesh-edge and the hashed, scoped file the gateway reads
    too reach the authorizer beside Envoy; neither the renderer nor Envoy sees a key."""
    deployment, render, envoy_container = edge(overlay)
    checker = authorizer(overlay)
    assert checker["image"] == render["image"]
    assert not [n for n in env_of(render) if "API_KEY" in n]
    assert "env" not in envoy_container
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    (mount,) = [m for m in checker["volumeMounts"] if m["name"] == "api-keys"]
    assert volumes["api-keys"]["secret"]["secretName"] == "aimesh-gateway-keys"
    keys_file = env_of(checker)["AIMESH_EDGE__API_KEYS_FILE"]["value"]
    assert PurePosixPath(keys_file).parent == PurePosixPath(mount["mountPath"])
    ref = env_of(checker)["AIMESH_EDGE__API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "aimesh-edge", "key": "api-keys"}
    secret = of_kind(overlay, "Secret")["aimesh-edge"]
    keys = json.loads(base64.b64decode(secret["data"]["api-keys"]))
    assert isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)


def run_guard(script: str, keys: str, tmp_path) -> subprocess.CompletedProcess[str]:
    """The init container's script, with a stand-in `aimesh` that prints its arguments."""
    fake = tmp_path / "aimesh"
    fake.write_text('#!/bin/sh\necho "rendered $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "AIMESH_EDGE__API_KEYS": keys}
    return subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True)


def test_the_edge_refuses_to_start_with_the_placeholder_key(rendered, tmp_path):
    script = authorizer(rendered["cpu"])["args"][-1]
    placeholder = of_kind(rendered["cpu"], "Secret")["aimesh-edge"]["data"]["api-keys"]
    refused = run_guard(script, base64.b64decode(placeholder).decode(), tmp_path)
    assert refused.returncode == 1
    assert "placeholder" in refused.stderr
    accepted = run_guard(script, '["a-real-key"]', tmp_path)
    assert accepted.returncode == 0, accepted.stderr
    assert accepted.stdout.strip() == "rendered edge authorize"


def test_an_own_overlay_sets_the_image_and_the_keys(tmp_path):
    """What docs/deploy.md tells operators to write, kept out of this repository."""
    (tmp_path / "api-keys.json").write_text('["k1", "k2"]')
    base = os.path.relpath(K8S / "overlays" / "cpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"""
resources:
  - {base}
images:
  - name: aimesh
    newName: team/aimesh
    newTag: "42"
secretGenerator:
  - name: aimesh-edge
    namespace: aimesh
    behavior: replace
    files:
      - api-keys=api-keys.json
    options:
      disableNameSuffixHash: true
"""
    )
    docs = documents(kustomize(tmp_path))
    secret = of_kind(docs, "Secret")["aimesh-edge"]
    assert json.loads(base64.b64decode(secret["data"]["api-keys"])) == ["k1", "k2"]
    images = {
        c["image"]
        for name in ("edge", "decode", "agent")
        for c in containers(of_kind(docs, "Deployment")[name])
    }
    assert images == {"team/aimesh:42", "envoyproxy/envoy:v1.40.0"}


def test_the_gateway_reads_its_keys_from_a_secret_the_edge_defers_to(overlay, deployed):
    """The gateway's api_keys_file lies in a mounted Secret directory (no subPath, so a
    rotated Secret reaches the running pod); the committed Secret holds no key, so the
    OpenAI paths refuse every call until an operator replaces it; and the edge, rendered
    with the same config, leaves those paths' keys to the gateway."""
    assert "gateway" in deployed
    keys_file = config_toml()["services"]["gateway"]["api_keys_file"]
    (container,) = containers(of_kind(overlay, "Deployment")["gateway"])
    directory, name = keys_file.rsplit("/", 1)
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == directory)
    assert "subPath" not in mount and mount["readOnly"]
    (volume,) = (
        v for v in pod_spec(of_kind(overlay, "Deployment")["gateway"])["volumes"]
        if v["name"] == mount["name"]
    )  # fmt: skip
    secret = of_kind(overlay, "Secret")[volume["secret"]["secretName"]]
    committed = KeyFile.model_validate_json(base64.b64decode(secret["data"][name]))
    assert committed.keys == []
    settings = MeshSettings.model_construct(
        services={"gateway": ServiceSettings.model_validate(config_toml()["services"]["gateway"])}
    )
    (gateway,) = envoy.upstreams_for([discover()["gateway"]], settings)
    assert gateway.http is not None and gateway.http.own_keys
