"""The Triton option (k8s/components/triton, applied by k8s/overlays/gpu-triton): Triton on
one GPU per pod, probed through its own health endpoints, serving every model of
k8s/triton-model-repository with its artifacts; every model-running service configured,
through the project's own settings classes, to run its model there; prefill and decode,
which nothing calls any more, gone; and no GPU left to a pod but Triton's. conftest
renders and strictly validates the overlay with the others, and the generic checks of
test_manifests.py, test_observability.py and test_edge.py cover it too."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from urllib.parse import urlsplit

import pytest
from google.protobuf import text_format
from packaging.requirements import Requirement
from pydantic import BaseModel
from tritonclient.grpc import model_config_pb2

from loadtest.triton_server import ADMIN_KEY_NAME, ADMIN_PROTOCOLS
from loadtest.triton_server import REQUIREMENTS as TESTED_SERVER_REQUIREMENTS
from mesh.config import MeshSettings, ServiceOptions
from mesh.triton import TritonSettings
from services.diffusion.settings import DiffusionSettings
from services.embedder.settings import EmbedderSettings
from services.generation.settings import RouterOptions
from services.rerank.settings import RerankSettings
from tests.conftest import ROOT
from tests.k8s.conftest import (
    K8S,
    NAMESPACE,
    NOT_DEPLOYED,
    Doc,
    config_toml,
    containers,
    deployable,
    documents,
    env_of,
    gpus,
    kustomize,
    load_script,
    of_kind,
    otlp_receiver,
    pod_settings,
    pod_spec,
)

pytestmark = pytest.mark.system

OPTION = "gpu-triton"
COMPONENT = K8S / "components" / "triton"
REPOSITORY = K8S / "triton-model-repository"
MODELS = sorted(config.parent.name for config in REPOSITORY.glob("*/config.pbtxt"))
TRITON_OBJECTS = {
    ("Deployment", "triton"),
    ("Service", "triton"),
    ("PodDisruptionBudget", "triton"),
    ("NetworkPolicy", "triton"),
}
WORKER_KINDS = (
    "Deployment",
    "Service",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
)
TRACE_CONFIG = "--trace-config="


def embedder_on_triton(engine: EmbedderSettings) -> TritonSettings | None:
    assert engine.backend == "triton"
    return engine.triton


def rerank_on_triton(engine: RerankSettings) -> TritonSettings | None:
    assert engine.backend == "triton"
    return engine.triton


def diffusion_on_triton(engine: DiffusionSettings) -> TritonSettings | None:
    assert engine.terrain_backend == "triton" and "terrain" in engine.models
    return engine.triton


def generation_on_triton(options: RouterOptions) -> TritonSettings | None:
    assert options.backend == "triton"
    return options.triton


@dataclass(frozen=True)
class OnTriton:
    """A service whose model runs on Triton in the option."""

    model: str
    # Its settings in the environment (and nothing else there is new).
    env_prefix: str
    # Its own settings class, which reads and validates them as the service does ...
    options: type[ServiceOptions]
    # ... and their Triton section, once checked that they choose the Triton backend.
    triton: Callable[[BaseModel], TritonSettings | None]
    # What else the option changes on its Deployment (see differences()).
    changes: frozenset[str]
    # ModelStreamInfer to a decoupled model, or ModelInfer.
    streams: bool = False


RESOURCES = frozenset({"container.env", "container.resources"})
ON_TRITON = {
    "embedder": OnTriton(
        "sentence_embedding",
        "AIMESH_SERVICES__EMBEDDER__",
        EmbedderSettings,
        embedder_on_triton,
        RESOURCES,
    ),
    "rerank": OnTriton(
        "token_embedding", "AIMESH_SERVICES__RERANK__", RerankSettings, rerank_on_triton, RESOURCES
    ),
    # Off the GPU nodes: digits runs on the CPU (test_diffusion_leaves_the_gpu_nodes...).
    "diffusion": OnTriton(
        "terrain_denoiser",
        "AIMESH_SERVICES__DIFFUSION__",
        DiffusionSettings,
        diffusion_on_triton,
        RESOURCES | {"pod.tolerations", "pod.nodeSelector", "spec.strategy"},
    ),
    # Same resources and startup probe (the base's already waits as long as Triton's).
    "generation": OnTriton(
        "text_generation",
        "AIMESH_SERVICES__GENERATION__",
        RouterOptions,
        generation_on_triton,
        frozenset({"container.env"}),
        streams=True,
    ),
}


def by_key(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def differences(before: Doc, after: Doc) -> set[str]:
    """Where two versions of a one-container Deployment differ: `spec.<field>` outside the
    pod template, `pod.<field>` of its pod spec, `container.<field>`, or `metadata` and
    `template.metadata` as wholes."""
    changed = {key for key in ("metadata",) if before[key] != after[key]}
    if before["spec"]["template"]["metadata"] != after["spec"]["template"]["metadata"]:
        changed.add("template.metadata")
    levels = {
        "spec": (before["spec"], after["spec"], {"template"}),
        "pod": (pod_spec(before), pod_spec(after), {"containers"}),
        "container": (*(pod_spec(d)["containers"][0] for d in (before, after)), set()),
    }
    for level, (old, new, inside) in levels.items():
        for key in (old.keys() | new.keys()) - inside:
            if old.get(key) != new.get(key):
                changed.add(f"{level}.{key}")
    assert len(pod_spec(before)["containers"]) == len(pod_spec(after)["containers"]) == 1
    return changed


def triton(docs: list[Doc]) -> tuple[Doc, Doc, dict[str, str]]:
    """Triton's Deployment, its container and the server's options (`--name=value` after
    the command), each once but --trace-config, one setting per argument (trace_config)."""
    deployment = of_kind(docs, "Deployment")["triton"]
    (container,) = containers(deployment)
    command, *args = container["args"]
    assert command == "tritonserver"
    assert all(re.fullmatch(r"--[a-z-]+=\S+", arg) for arg in args), args
    once = [arg for arg in args if not arg.startswith(TRACE_CONFIG)]
    options = dict(arg.removeprefix("--").split("=", 1) for arg in once)
    assert len(options) == len(once), "an option given twice"
    return deployment, container, options


def trace_config(container: Doc) -> tuple[dict[str, str], dict[str, str]]:
    """Triton's --trace-config settings (`setting=value`, or `mode,setting=value` for one
    trace mode's), each given once, and the resource attributes of its spans
    (`opentelemetry,resource=key=value`, one per argument)."""
    settings: dict[str, str] = {}
    resource: dict[str, str] = {}
    for arg in container["args"]:
        if not arg.startswith(TRACE_CONFIG):
            continue
        setting, value = arg.removeprefix(TRACE_CONFIG).split("=", 1)
        if setting == "opentelemetry,resource":
            into, (key, value) = resource, value.split("=", 1)
        else:
            into, key = settings, setting
        assert key not in into, f"{arg}: given twice"
        into[key] = value
    return settings, resource


def model_config(model: str) -> model_config_pb2.ModelConfig:
    """The model's config.pbtxt as Triton reads it: an unknown field or a bad value fails."""
    text = (REPOSITORY / model / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def load_artifacts() -> ModuleType:
    """k8s/components/triton/artifacts.py, the script the Triton image build runs."""
    return load_script(COMPONENT / "artifacts.py", "triton_artifacts")


def dockerfile() -> str:
    return (COMPONENT / "Dockerfile").read_text()


def mebibytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) * (1024 if unit == "Gi" else 1)


def cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def resources(docs: list[Doc], name: str) -> Doc:
    (container,) = containers(of_kind(docs, "Deployment")[name])
    return container["resources"]


def startup_s(container: Doc) -> int:
    probe = container["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def service_settings(docs: list[Doc], name: str, monkeypatch, tmp_path) -> MeshSettings:
    deployment = of_kind(docs, "Deployment")[name]
    (container,) = containers(deployment)
    return pod_settings(docs, deployment, container, monkeypatch, tmp_path)


def test_the_option_adds_triton_drops_the_llm_workers_and_changes_the_services_on_it(rendered):
    gpu, option = by_key(rendered["gpu"]), by_key(rendered[OPTION])
    workers = {(kind, name) for kind in WORKER_KINDS for name in NOT_DEPLOYED[OPTION]}
    assert workers <= set(gpu)
    assert set(option) == (set(gpu) - workers) | TRITON_OBJECTS
    changed = {key for key, doc in option.items() if key in gpu and gpu[key] != doc}
    assert changed == {("Deployment", name) for name in ON_TRITON}
    for name, service in ON_TRITON.items():
        before, after = gpu["Deployment", name], option["Deployment", name]
        assert differences(before, after) == service.changes, name
        # The environment gains the service's Triton settings, and only those.
        (old,), (new,) = containers(before), containers(after)
        added = [e for e in new["env"] if e not in old["env"]]
        assert added and all(e["name"].startswith(service.env_prefix) for e in added), name
        assert [e for e in new["env"] if e not in added] == old["env"]
        assert not any(e["name"].startswith(service.env_prefix) for e in old["env"]), name
    for kind, name in TRITON_OBJECTS:
        assert option[kind, name]["metadata"]["namespace"] == NAMESPACE


def test_no_pod_but_tritons_takes_a_gpu(rendered):
    docs = rendered[OPTION]
    assert gpus(docs) == {"triton": 1}
    deployment, _, _ = triton(docs)
    # Placed as the gpu overlay places its GPU pods.
    spec = pod_spec(deployment)
    prefill = pod_spec(of_kind(rendered["gpu"], "Deployment")["prefill"])
    assert spec["tolerations"] == prefill["tolerations"]
    assert spec["nodeSelector"] == prefill["nodeSelector"]
    # No spare GPU needed for a rollout, and a pod left serving during a disruption.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert deployment["spec"]["replicas"] >= 2
    budget = of_kind(docs, "PodDisruptionBudget")["triton"]
    assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_triton_requests_a_cpu_per_model_instance(rendered):
    """The Python backend runs each model instance in a stub process of its own; KIND_AUTO
    places `count` instances on each GPU of the pod."""
    docs = rendered[OPTION]
    _, container, _ = triton(docs)
    per_gpu = sum(group.count for m in MODELS for group in model_config(m).instance_group)
    assert per_gpu == len(MODELS)  # one instance each, as triton.yaml and the docs say
    instances = per_gpu * gpus(docs)["triton"]
    assert cpus(container["resources"]["requests"]["cpu"]) >= instances


def test_triton_serves_grpc_through_its_service_and_metrics_to_prometheus(rendered):
    docs = rendered[OPTION]
    deployment, container, options = triton(docs)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {
        "grpc": int(options["grpc-port"]),
        "http": int(options["http-port"]),
        "metrics": int(options["metrics-port"]),
    }
    assert (ports["grpc"], ports["metrics"]) == (8001, 8002)
    # Clients reach gRPC only: the HTTP endpoint is for the kubelet's probes.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    reaching = [
        service
        for service in of_kind(docs, "Service").values()
        if service["spec"]["selector"].items() <= labels.items()
    ]
    assert [service["metadata"]["name"] for service in reaching] == ["triton"]
    (service,) = reaching
    assert service["spec"].get("clusterIP") != "None"
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"], port["appProtocol"]) == (
        ports["grpc"],
        "grpc",
        "grpc",
    )
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert options["allow-metrics"] == "true"
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == options["metrics-port"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_triton_is_ready_when_every_model_is_and_live_apart_from_that(rendered):
    _, container, options = triton(rendered[OPTION])
    assert options["allow-http"] == "true"
    # Strict readiness: /v2/health/ready answers 200 only once every model is ready.
    assert options["strict-readiness"] == "true"
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_triton_traces_every_request_into_its_callers_trace_at_the_collector(rendered):
    """OpenTelemetry mode: Triton's spans join the trace whose context the services send in
    the traceparent header, every request of them as the services trace every call, named
    "triton", exported over OTLP/HTTP (Triton's only OTLP protocol) to the collector's
    Service port that leads to its OTLP/HTTP receiver."""
    docs = rendered[OPTION]
    _, container, _ = triton(docs)
    settings, resource = trace_config(container)
    assert settings["mode"] == "opentelemetry"
    assert settings["rate"] == "1"
    assert settings["level"] == "TIMESTAMPS"
    assert resource == {"service.name": "triton"}
    url = settings["opentelemetry,url"]
    assert urlsplit(url).scheme == "http"
    protocol, receiver = otlp_receiver(docs, url)
    assert protocol == "http"
    # The receiver's path for traces, /v1/traces unless its config names another.
    assert urlsplit(url).path == receiver.get("traces_url_path", "/v1/traces")
    # Nothing else: a `count` would stop tracing after that many requests.
    assert set(settings) == {"mode", "rate", "level", "opentelemetry,url"}


def test_triton_drains_and_rotates_connections_as_the_mesh_does(rendered):
    deployment, container, options = triton(rendered[OPTION])
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop > 0
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert grace > pre_stop + int(options["exit-timeout-secs"])
    transport = config_toml()["transport"]
    assert int(options["grpc-max-connection-age"]) == transport["max_connection_age_s"] * 1000
    assert (
        int(options["grpc-max-connection-age-grace"])
        == transport["max_connection_age_grace_s"] * 1000
    )


def test_triton_runs_unprivileged(rendered):
    deployment, container, _ = triton(rendered[OPTION])
    pod = pod_spec(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_every_model_config_is_a_valid_triton_model_config():
    """Each config.pbtxt parses as Triton's ModelConfig, names its directory, places its
    instances where the server has room (KIND_AUTO: the GPU when there is one), and
    declares decoupled exactly when its service streams from it (ModelStreamInfer)."""
    assert set(MODELS) >= {"sentence_embedding", "token_embedding", "terrain_denoiser"}
    streamed = {service.model for service in ON_TRITON.values() if service.streams}
    assert streamed == {"text_generation"}
    for model in MODELS:
        config = model_config(model)
        assert config.name == model
        assert config.backend == "python", model
        assert config.instance_group, f"{model}: no instance group"
        for group in config.instance_group:
            assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_AUTO, model
            assert group.count >= 1 and not group.gpus, model
        assert config.model_transaction_policy.decoupled == (model in streamed), model
        assert config.input and config.output, model


def test_every_model_directory_is_served_with_its_artifacts(rendered):
    """Triton loads every model of its repository (model-control-mode none) and stops on
    one that fails; the image holds the repository's layout at that path and, over it,
    what artifacts.py writes for each model: a directory without an entry there would
    stop every Triton pod."""
    for model in MODELS:
        assert (REPOSITORY / model / "1" / "model.py").is_file(), model
    _, _, options = triton(rendered[OPTION])
    assert options["model-control-mode"] == "none"
    assert options["exit-on-error"] == "true"
    assert sorted(load_artifacts().ARTIFACTS) == MODELS

    text = dockerfile()
    copies = re.findall(r"^COPY (?:--from=(\S+) )?(\S+) (\S+)$", text, re.M)
    for stage, source, _ in copies:
        if not stage:
            assert (K8S / source).exists(), f"{source}: not in the build context, k8s/"
    served = options["model-repository"]
    assert ("", "triton-model-repository", served) in copies
    (stage, written) = next((s, source) for s, source, target in copies if s and target == served)
    assert re.search(rf"^FROM \S+ AS {stage}$", text, re.M)
    assert "COPY components/triton/artifacts.py /tmp/artifacts.py" in text.splitlines()
    assert f"RUN python /tmp/artifacts.py {written}" in text.splitlines()
    # The layout first, the artifacts over it.
    assert text.index(" triton-model-repository ") < text.index(f"--from={stage} ")


def test_image_installs_what_the_tested_server_runs():
    """The models import in Triton's Python what the tests' Triton has (PyTriton's server,
    CPU ONNX Runtime); the image has its own server and ONNX Runtime's GPU build."""
    tested = {(r := Requirement(line)).name: r.specifier for line in TESTED_SERVER_REQUIREMENTS}
    del tested["nvidia-pytriton"]
    tested["onnxruntime-gpu"] = tested.pop("onnxruntime")
    lines = (COMPONENT / "requirements.txt").read_text().splitlines()
    image = {
        (r := Requirement(line)).name: r.specifier
        for line in lines
        if line.strip() and not line.startswith("#")
    }
    assert image == tested
    assert "COPY components/triton/requirements.txt /tmp/requirements.txt" in dockerfile()
    assert "pip install --no-cache-dir -r /tmp/requirements.txt" in dockerfile()


def test_triton_image_is_built_from_images_you_name(rendered):
    text = dockerfile()
    bases = re.findall(r"^FROM (\S+)", text, re.M)
    assert bases and all(re.fullmatch(r"\$\{\w+\}", base) for base in bases), bases
    for base in bases:
        # Required at build time: no default names an image (or a registry).
        assert re.search(rf"^ARG {base[2:-1]}$", text, re.M), base
    # The overlay sets the image the component leaves as a placeholder.
    _, placeholder, _ = triton(documents((COMPONENT / "triton.yaml").read_text()))
    _, container, _ = triton(rendered[OPTION])
    assert container["image"] != placeholder["image"]
    assert container["image"].split(":")[0] == placeholder["image"].split(":")[0]


def test_an_own_overlay_pins_the_triton_image_by_digest(tmp_path):
    """What docs/deploy.md tells operators to write: the image they built, by digest, so
    a re-pushed tag cannot change what runs."""
    digest = "sha256:" + "ab" * 32
    base = os.path.relpath(K8S / "overlays" / OPTION, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"""
resources:
  - {base}
images:
  - name: aimesh-triton
    newName: team/aimesh-triton
    digest: {digest}
"""
    )
    _, container, _ = triton(documents(kustomize(tmp_path)))
    assert container["image"] == f"team/aimesh-triton@{digest}"


@pytest.mark.parametrize("name", sorted(ON_TRITON))
def test_service_runs_its_model_on_triton(rendered, name, monkeypatch, tmp_path):
    """The service's settings as its pods read them (the mounted aimesh.toml, then the
    environment) pass its own settings class and name Triton's Service, its gRPC port and
    a model of the repository."""
    docs = rendered[OPTION]
    service = ON_TRITON[name]
    settings = service.triton(
        service.options.of(service_settings(docs, name, monkeypatch, tmp_path), name)
    )
    assert isinstance(settings, TritonSettings)
    assert settings.model == service.model
    assert settings.model in MODELS

    host, port = settings.url.rsplit(":", 1)
    service_name, namespace = host.split(".")[:2]
    assert host == f"{service_name}.{namespace}.svc.cluster.local"
    kube_service = of_kind(docs, "Service")[service_name]
    assert kube_service["metadata"]["namespace"] == namespace
    assert int(port) in [p["port"] for p in kube_service["spec"]["ports"]]
    triton_deployment, _, options = triton(docs)
    pod_labels = triton_deployment["spec"]["template"]["metadata"]["labels"]
    assert kube_service["spec"]["selector"].items() <= pod_labels.items()
    assert port == options["grpc-port"]


def test_every_model_triton_serves_is_used():
    """Triton loads every model of its repository onto each pod's GPU: one no service
    calls would only take memory there."""
    assert sorted(service.model for service in ON_TRITON.values()) == MODELS


def test_the_router_keeps_its_service_settings_and_streams_as_long_as_the_mesh_does(
    rendered, monkeypatch, tmp_path
):
    """The options from the environment merge into [services.generation] of aimesh.toml
    (it still listens, drains and is reached as there), and a stream to Triton may run as
    long as a generation stream the router sent to decode: client.default_stream_deadline_s
    when its caller brings no deadline, not TritonSettings' 30 s for one inference."""
    settings = service_settings(rendered[OPTION], "generation", monkeypatch, tmp_path)
    service = settings.service("generation")
    from_file = config_toml()["services"]["generation"]
    assert {key: getattr(service, key) for key in from_file} == from_file
    options = RouterOptions.of(settings, "generation")
    assert options.triton is not None
    assert options.triton.timeout_s == settings.client.default_stream_deadline_s
    # Nothing left that would send it to prefill or decode.
    assert (options.prefill, options.decode) == ([], [])


def test_services_on_triton_wait_as_long_as_triton_may_take_to_start(rendered):
    """They are not ready (and not started, for their startup probe) until Triton has their
    model, so their startup probes allow at least what Triton's allows."""
    docs = rendered[OPTION]
    _, container, _ = triton(docs)
    for name in ON_TRITON:
        (service,) = containers(of_kind(docs, "Deployment")[name])
        assert startup_s(service) >= startup_s(container), name


def test_services_on_triton_need_less_memory_and_the_router_the_same(rendered):
    for name in ON_TRITON:
        on_triton, in_process = resources(rendered[OPTION], name), resources(rendered["gpu"], name)
        assert "nvidia.com/gpu" not in on_triton.get("limits", {}), name
        if name == "generation":
            # It loads no model in either mode.
            assert on_triton == in_process
            continue
        for kind in ("requests", "limits"):
            assert mebibytes(on_triton[kind]["memory"]) < mebibytes(in_process[kind]["memory"])
        assert cpus(on_triton["requests"]["cpu"]) <= cpus(in_process["requests"]["cpu"])
    # The gpu overlay's services keep their models in process.
    for name in ON_TRITON:
        (container,) = containers(of_kind(rendered["gpu"], "Deployment")[name])
        assert not any(n.startswith(ON_TRITON[name].env_prefix) for n in env_of(container))


def test_diffusion_leaves_the_gpu_nodes_and_runs_digits_on_the_cpus_it_requests(
    rendered, monkeypatch, tmp_path
):
    docs = rendered[OPTION]
    deployment = of_kind(docs, "Deployment")["diffusion"]
    engine = DiffusionSettings.of(
        service_settings(docs, "diffusion", monkeypatch, tmp_path), "diffusion"
    )
    assert engine.device == "cpu"
    (container,) = containers(deployment)
    assert engine.threads is not None
    assert math.isclose(engine.threads, cpus(container["resources"]["requests"]["cpu"]))
    # As on the CPU overlay: placed anywhere, rolled out with a surge pod.
    on_cpu = of_kind(rendered["cpu"], "Deployment")["diffusion"]
    assert deployment["spec"]["strategy"] == on_cpu["spec"]["strategy"]
    for field in ("tolerations", "nodeSelector"):
        assert field not in pod_spec(deployment)


def test_prefill_and_decode_are_gone_and_no_pod_names_them(rendered):
    docs = rendered[OPTION]
    gone = NOT_DEPLOYED[OPTION]
    assert gone == {"prefill", "decode"}
    assert not [doc for doc in docs if doc["metadata"]["name"] in gone]
    # No pod is given their addresses (the mounted aimesh.toml keeps their sections,
    # read by no pod here: the router's backend is Triton, see above).
    addresses = re.compile(rf"\b(?:{'|'.join(gone)})\.{NAMESPACE}\b")
    for workload in of_kind(docs, "Deployment").values():
        for container in containers(workload):
            text = " ".join(
                [*container.get("args", []), *container.get("command", [])]
                + [str(e.get("value", "")) for e in container.get("env", [])]
            )
            assert not addresses.search(text), workload["metadata"]["name"]


def deploy_section_8() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("\n## 8. Models on Triton Inference Server\n")
    return text[start : text.index("\n## ", start + 1)]


def test_the_documented_toml_is_what_the_pods_read(rendered, monkeypatch, tmp_path):
    """docs/deploy.md section 8 gives the option's settings as TOML: each service's
    settings from that file alone are the ones its pods read."""
    (block,) = re.findall(r"```toml\n(.*?)```", deploy_section_8(), re.S)
    documented = tmp_path / "documented.toml"
    documented.write_text(block)
    for name, service in ON_TRITON.items():
        in_pod = service.options.of(
            service_settings(rendered[OPTION], name, monkeypatch, tmp_path), name
        )
        for variable in [v for v in os.environ if v.startswith("AIMESH_")]:
            monkeypatch.delenv(variable)
        monkeypatch.setenv("AIMESH_CONFIG", str(documented))
        assert service.options.of(MeshSettings(), name) == in_pod, name


def test_the_documented_health_check_names_every_service_the_option_runs():
    (command,) = re.findall(r"aimesh health ((?:--only \w+[\s\\]*)+)", deploy_section_8())
    names = re.findall(r"--only (\w+)", command)
    assert len(names) == len(set(names))
    assert set(names) == deployable() - NOT_DEPLOYED[OPTION]


def test_tritons_admin_protocols_need_the_pods_own_key(rendered):
    """The protocols the mesh never calls are restricted on both APIs to a header only
    the pod's readers know; health, metadata and inference are not."""
    _, container, options = triton(rendered[OPTION])
    expected = f"{ADMIN_PROTOCOLS}:{ADMIN_KEY_NAME}=$(TRITON_ADMIN_KEY)"
    assert options["grpc-restricted-protocol"] == expected
    assert options["http-restricted-api"] == expected
    assert not {"health", "metadata", "inference"} & set(ADMIN_PROTOCOLS.split(","))
    key = env_of(container)["TRITON_ADMIN_KEY"]["valueFrom"]["fieldRef"]
    assert key == {"fieldPath": "metadata.uid"}
