"""The overlays rendered once per session (kustomize, then strict schema validation), and
helpers to find things in them."""

from __future__ import annotations

import base64
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import REGISTRY

from mesh.config import MeshSettings
from mesh.registry import discover
from tests.conftest import ROOT, VENV_BIN

K8S = ROOT / "k8s"
# gpu-triton: the gpu overlay with k8s/components/triton (tests/k8s/test_triton.py);
# cpu-mtls: the cpu overlay with k8s/components/mtls (tests/k8s/test_mtls.py).
OVERLAYS = ("cpu", "gpu", "gpu-triton", "cpu-mtls")
NAMESPACE = "aimesh"
GPU_SERVICES = {"prefill", "decode", "diffusion"}
# Mesh services that also serve HTTP (the gateway's OpenAI-compatible API, on its
# `http_port`): a second port of their Service, and the edge routes to it.
HTTP_SERVICES = frozenset({"gateway"})
# Mesh services an overlay does not run: in gpu-triton the generation router streams from
# Triton and nothing calls prefill or decode, so k8s/components/triton deletes them.
NOT_DEPLOYED = {"gpu-triton": frozenset({"prefill", "decode"})}
# Light modules that define every metric the manifests, rules and dashboard may name.
METRIC_MODULES = (
    "mesh.metrics",
    "mesh.admission",
    "mesh.breaker",
    "services.llm.metrics",
    "services.diffusion.metrics",
    "services.embedder.engine",
)

Doc = dict[str, Any]
# A $(VAR) reference in an env value, command or args, which the kubelet expands.
KUBELET_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kustomize(directory: Path) -> str:
    return subprocess.run(
        [str(VENV_BIN / "kubectl"), "kustomize", str(directory)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def documents(text: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> dict[str, list[Doc]]:
    """Each overlay, rendered and checked against the Kubernetes 1.37 schemas, strictly
    (unknown fields fail), in one validator run."""
    directory = tmp_path_factory.mktemp("k8s")
    texts = {overlay: kustomize(K8S / "overlays" / overlay) for overlay in OVERLAYS}
    paths = []
    for overlay, text in texts.items():
        path = directory / f"{overlay}.yaml"
        path.write_text(text)
        paths.append(str(path))
    validation = subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", "--quiet", *paths],
        capture_output=True,
        text=True,
    )
    assert validation.returncode == 0, validation.stdout + validation.stderr
    return {overlay: documents(text) for overlay, text in texts.items()}


@pytest.fixture(scope="session", params=OVERLAYS)
def overlay_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def overlay(overlay_name, rendered) -> list[Doc]:
    return rendered[overlay_name]


@pytest.fixture(scope="session")
def deployed(overlay_name) -> set[str]:
    """The mesh services the overlay runs."""
    return deployable() - NOT_DEPLOYED.get(overlay_name, frozenset())


def deployable() -> set[str]:
    """Every mesh service but the diagnostic ones (k8s/components/diagnostics)."""
    return {name for name, spec in discover().items() if not spec.diagnostic}


def of_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def workloads(docs: list[Doc]) -> dict[str, Doc]:
    return {**of_kind(docs, "Deployment"), **of_kind(docs, "StatefulSet")}


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def containers(workload: Doc, *, init: bool = True) -> Iterator[Doc]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", []) if init else ()
    yield from spec["containers"]


def gpus(docs: list[Doc]) -> dict[str, int]:
    """The GPUs each workload's pods take, by workload name, for those that take any."""
    return {
        name: container["resources"].get("limits", {})["nvidia.com/gpu"]
        for name, workload in workloads(docs).items()
        for container in containers(workload)
        if "nvidia.com/gpu" in container.get("resources", {}).get("limits", {})
    }


def env_of(container: Doc) -> dict[str, Doc]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def mounted_file(docs: list[Doc], workload: Doc, container: Doc, path: str) -> str:
    """The text `container` of `workload` reads at `path`: a key of the ConfigMap in
    `docs` mounted at its directory."""
    mount_path, file_name = path.rsplit("/", 1)
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == mount_path)
    (volume,) = (v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    return of_kind(docs, "ConfigMap")[volume["configMap"]["name"]]["data"][file_name]


def otlp_receiver(docs: list[Doc], url: str) -> tuple[str, Doc]:
    """The protocol of the collector's OTLP receiver that `url` reaches in `docs`, and its
    settings: the URL's host names a Service in its namespace, its port is one of that
    Service's, whose target port is the collector container's, where one protocol of the
    receiver that the collector's traces pipeline takes (in the config its pod mounts)
    listens."""
    endpoint = urlsplit(url)
    name, namespace = endpoint.hostname.split(".")[:2]
    assert endpoint.hostname == f"{name}.{namespace}.svc.cluster.local"
    service = of_kind(docs, "Service")[name]
    assert service["metadata"]["namespace"] == namespace
    (port,) = (p for p in service["spec"]["ports"] if p["port"] == endpoint.port)
    collector = of_kind(docs, "Deployment")[name]
    labels = collector["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = containers(collector)
    (target,) = (p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"])
    (config_path,) = (arg.removeprefix("--config=") for arg in container["args"])
    config = yaml.safe_load(mounted_file(docs, collector, container, config_path))
    assert "otlp" in config["service"]["pipelines"]["traces"]["receivers"]
    protocols = config["receivers"]["otlp"]["protocols"]
    (protocol,) = (p for p, s in protocols.items() if s["endpoint"] == f"0.0.0.0:{target}")
    return protocol, protocols[protocol]


def secret_value(docs: list[Doc], ref: Doc) -> str:
    """The value of a secretKeyRef, from the overlay's Secret."""
    secret = of_kind(docs, "Secret")[ref["name"]]
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def pod_environment(docs: list[Doc], container: Doc, **given: str) -> dict[str, str]:
    """The environment Kubernetes gives `container`: each variable in order, literal or
    from a Secret of the overlay (`given` overrides, e.g. for what a fieldRef reads), each
    $(VAR) of a variable defined before it expanded as the kubelet does (others are left)."""
    environment: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if name in given:
            environment[name] = given[name]
        elif "value" in entry:
            environment[name] = KUBELET_REFERENCE.sub(
                lambda found: environment.get(found[1], found[0]), entry["value"]
            )
        elif "secretKeyRef" in entry["valueFrom"]:
            environment[name] = secret_value(docs, entry["valueFrom"]["secretKeyRef"])
    return environment


def pod_settings(
    docs: list[Doc], workload: Doc, container: Doc, monkeypatch, directory: Path, **env: str
) -> MeshSettings:
    """The mesh settings `container` of `workload` reads in its pod: the overlay's ConfigMap
    mounted where its AIMESH_CONFIG points, then its AIMESH_* environment (pod_environment:
    Secrets' values, $(VAR) expanded), then `env` (for values the test stands in for)."""
    path = env_of(container)["AIMESH_CONFIG"]["value"]
    config = directory / path.rsplit("/", 1)[1]
    config.write_text(mounted_file(docs, workload, container, path))

    for name in list(os.environ):
        if name.startswith("AIMESH_"):
            monkeypatch.delenv(name)
    variables = {**pod_environment(docs, container, **env), **env}
    aimesh = {n: v for n, v in variables.items() if n.startswith("AIMESH_")}
    for name, value in {**aimesh, "AIMESH_CONFIG": str(config)}.items():
        assert "$(" not in value, f"{name}: Kubernetes expands $(VAR) there, this does not"
        monkeypatch.setenv(name, value)
    return MeshSettings()


def config_toml() -> dict[str, Any]:
    return tomllib.loads((K8S / "base" / "aimesh.toml").read_text())


def load_script(path: Path, name: str) -> ModuleType:
    """A script of k8s/ rather than a package module, loaded afresh each time (tests patch
    it); registered while it runs, as dataclasses need."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def load_render() -> ModuleType:
    return load_script(K8S / "render.py", "k8s_render")


def exported_metrics() -> dict[str, str]:
    """Every series name the processes can expose, with its metric type: counters as
    NAME_total, histograms as NAME_bucket / NAME_sum / NAME_count, gauges as NAME."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    names: dict[str, str] = {}
    for family in REGISTRY.collect():
        if family.type == "counter":
            names[f"{family.name}_total"] = "counter"
        elif family.type == "histogram":
            names.update({f"{family.name}{s}": "histogram" for s in ("_bucket", "_sum", "_count")})
        else:
            names[family.name] = family.type
    return names
