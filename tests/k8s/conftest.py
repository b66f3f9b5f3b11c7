"""The overlays rendered once per session (kustomize, then strict schema validation), and
helpers to find things in them."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from tests.conftest import ROOT, VENV_BIN

K8S = ROOT / "k8s"
OVERLAYS = ("cpu", "gpu")
NAMESPACE = "aimesh"
GPU_SERVICES = {"prefill", "decode", "diffusion"}
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
def overlay(request, rendered) -> list[Doc]:
    return rendered[request.param]


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


def env_of(container: Doc) -> dict[str, Doc]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def config_toml() -> dict[str, Any]:
    return tomllib.loads((K8S / "base" / "aimesh.toml").read_text())


def load_render() -> ModuleType:
    """k8s/render.py, a script rather than a package module, loaded afresh each time (tests
    patch it); registered while it runs, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


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
