"""The rendered overlays agree with the mesh: every service deployed, probed, drained,
autoscaled and reachable the way mesh/ and services/ say; GPUs exactly where they belong."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from mesh.config import MeshSettings
from mesh.registry import discover, options_problems
from services.llm.settings import llm_settings
from services.retrieval.settings import RetrievalSettings
from tests.k8s.conftest import (
    GPU_SERVICES,
    HTTP_SERVICES,
    K8S,
    NAMESPACE,
    NOT_DEPLOYED,
    OVERLAYS,
    Doc,
    config_toml,
    containers,
    env_of,
    exported_metrics,
    gpus,
    load_render,
    of_kind,
    otlp_receiver,
    pod_spec,
    workloads,
)

pytestmark = pytest.mark.system

SPECS = discover()
OTLP_ENDPOINT = f"http://otel-collector.{NAMESPACE}.svc.cluster.local:4317"


def mesh_deployments(docs: list[Doc]) -> dict[str, Doc]:
    return {n: d for n, d in of_kind(docs, "Deployment").items() if n in SPECS}


def selected(service_or_budget: Doc, docs: list[Doc]) -> list[Doc]:
    """The workloads whose pods a Service's selector or a PDB's matchLabels pick."""
    spec = service_or_budget["spec"]
    selector = spec["selector"].get("matchLabels", spec["selector"])
    return [
        w
        for w in workloads(docs).values()
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def test_every_mesh_service_has_a_deployment_service_budget_and_autoscaler(overlay, deployed):
    assert len(SPECS) >= 11
    assert deployed <= set(SPECS)
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"):
        present = set(of_kind(overlay, kind)) & set(SPECS)
        assert present == deployed, f"{kind}: {sorted(present ^ deployed)}"


def probe_port(container: Doc) -> int:
    """Where the kubelet asks a mesh container for its health: its gRPC port, or under
    mutual TLS (k8s/components/mtls) its plaintext health port, a declared port too."""
    port = SPECS[container["name"]].default_port
    offset = env_of(container).get("AIMESH_TLS__HEALTH_PORT_OFFSET")
    if offset is None:
        return port
    health = port + int(offset["value"])
    assert {"name": "health", "containerPort": health} in container["ports"]
    return health


def test_grpc_probes_follow_the_health_contract(overlay):
    """Liveness asks for "" (process up), readiness and startup for the service by name
    (model loaded, not draining), on the service's own gRPC port (or its health port)."""
    for name, deployment in mesh_deployments(overlay).items():
        (container,) = containers(deployment)
        assert {"name": "grpc", "containerPort": SPECS[name].default_port} in container["ports"]
        port = probe_port(container)
        assert container["livenessProbe"]["grpc"] == {"port": port}
        for probe in ("readinessProbe", "startupProbe"):
            assert container[probe]["grpc"] == {"port": port, "service": name}, (name, probe)
        startup = container["startupProbe"]
        budget_s = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget_s >= (300 if name in GPU_SERVICES else 60), (name, budget_s)


def test_every_grpc_probe_names_a_real_service_on_its_port(overlay, deployed):
    probed = 0
    for workload in workloads(overlay).values():
        for container in containers(workload):
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                grpc = container.get(probe, {}).get("grpc")
                if grpc is None:
                    continue
                probed += 1
                name = container["name"]
                assert name in SPECS, f"{name} probes over gRPC but is no mesh service"
                assert grpc.get("service", "") in ("", name)
                assert grpc["port"] == probe_port(container)
    assert probed == 3 * len(deployed)


def test_http_apis_listen_on_every_interface_on_a_declared_port(overlay, deployed):
    """The gateway's HTTP listener follows its service's host (0.0.0.0 in a pod, or the
    kubelet and the edge could not reach it) on the port its container and Service name."""
    services = config_toml()["services"]
    deployments = of_kind(overlay, "Deployment")
    assert deployed >= HTTP_SERVICES
    for name in HTTP_SERVICES:
        settings = services[name]
        assert settings["host"] == "0.0.0.0"
        (container,) = containers(deployments[name])
        assert {"name": "http", "containerPort": settings["http_port"]} in container["ports"]
        service = of_kind(overlay, "Service")[name]
        assert {
            "name": "http",
            "port": settings["http_port"],
            "targetPort": "http",
            "appProtocol": "http",
        } in service["spec"]["ports"]


def test_termination_grace_covers_prestop_and_drain(overlay):
    services = config_toml()["services"]
    for name, deployment in mesh_deployments(overlay).items():
        spec = pod_spec(deployment)
        pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop > 0
        assert spec["terminationGracePeriodSeconds"] > pre_stop + services[name]["grace_s"], name
    edge = pod_spec(of_kind(overlay, "Deployment")["edge"])
    # Envoy drains in its preStop; its authorizer answers until Envoy is done.
    sleeps = {c["name"]: c["lifecycle"]["preStop"]["sleep"]["seconds"] for c in edge["containers"]}
    assert sleeps["authorizer"] >= sleeps["envoy"]
    assert edge["terminationGracePeriodSeconds"] > max(sleeps.values())


def test_every_service_port_reaches_a_container_port(overlay):
    for name, service in of_kind(overlay, "Service").items():
        pods = selected(service, overlay)
        assert pods, f"Service {name} selects no workload"
        for workload in pods:
            ports = [p for c in containers(workload, init=False) for p in c.get("ports", [])]
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                key = "name" if isinstance(target, str) else "containerPort"
                assert any(p.get(key) == target for p in ports), (name, port)


def test_mesh_services_are_headless_and_the_edge_is_not(overlay, deployed):
    services = of_kind(overlay, "Service")
    http_ports = {
        n: s["http_port"] for n, s in config_toml()["services"].items() if "http_port" in s
    }
    for name in deployed:
        assert services[name]["spec"]["clusterIP"] == "None", name
        port, *http = services[name]["spec"]["ports"]
        assert port["port"] == SPECS[name].default_port
        # Only a service with an HTTP API has a second port: that API's, as configured.
        expected = [http_ports[name]] if name in HTTP_SERVICES else []
        assert [(p["name"], p["port"]) for p in http] == [("http", p) for p in expected], name
    assert services["edge"]["spec"].get("clusterIP") != "None"
    assert [p["port"] for p in services["edge"]["spec"]["ports"]] == [8080]


def test_autoscalers_keep_two_pods_and_scale_on_exported_gauges(overlay):
    metrics = exported_metrics()
    deployments = of_kind(overlay, "Deployment")
    for name, hpa in of_kind(overlay, "HorizontalPodAutoscaler").items():
        spec = hpa["spec"]
        assert spec["minReplicas"] >= 2, name
        assert spec["maxReplicas"] >= spec["minReplicas"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        # The HPA owns the replica count; `kubectl apply` must not reset it.
        assert "replicas" not in target["spec"], name
        pods_metrics = [m["pods"]["metric"]["name"] for m in spec["metrics"] if m["type"] == "Pods"]
        for metric in pods_metrics:
            assert metrics.get(metric) == "gauge", f"{name} scales on {metric}: no such gauge"
        if name in GPU_SERVICES:
            assert pods_metrics, f"{name} must scale on its queue / in-flight work"
        if any(m["type"] == "Resource" for m in spec["metrics"]):
            for container in pod_spec(target)["containers"]:  # utilization needs them all
                assert container["resources"]["requests"]["cpu"], name


def test_disruption_budgets_leave_pods_running(overlay, deployed):
    hpas = of_kind(overlay, "HorizontalPodAutoscaler")
    for name, budget in of_kind(overlay, "PodDisruptionBudget").items():
        (workload,) = selected(budget, overlay)
        smallest = (
            hpas[name]["spec"]["minReplicas"] if name in hpas else workload["spec"]["replicas"]
        )
        assert budget["spec"]["maxUnavailable"] < smallest, name
    assert set(of_kind(overlay, "PodDisruptionBudget")) >= {*deployed, "edge", "qdrant"}


def test_gpu_overlay_gives_one_gpu_to_exactly_the_model_services(rendered):
    assert gpus(rendered["gpu"]) == dict.fromkeys(GPU_SERVICES, 1)
    deployments = of_kind(rendered["gpu"], "Deployment")
    for name in GPU_SERVICES:
        spec = pod_spec(deployments[name])
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
        assert spec["nodeSelector"]
    assert gpus(rendered["cpu"]) == {}
    assert not any("tolerations" in pod_spec(w) for w in workloads(rendered["cpu"]).values())


def test_only_pods_that_take_a_gpu_go_to_gpu_nodes_and_they_roll_without_a_spare(overlay):
    """A pod without a GPU on a GPU node holds CPU and memory the GPU pods need there; a
    pod with one must not need a spare GPU to roll out."""
    with_gpu = gpus(overlay)
    for name, deployment in of_kind(overlay, "Deployment").items():
        spec = pod_spec(deployment)
        tolerates = any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
        selects = "nvidia.com/gpu.present" in spec.get("nodeSelector", {})
        assert tolerates == selects == (name in with_gpu), name
        if name in with_gpu:
            rolling = deployment["spec"]["strategy"]["rollingUpdate"]
            assert rolling == {"maxSurge": 0, "maxUnavailable": 1}, name


def test_every_mesh_pod_exports_traces_to_the_collector(overlay):
    for name, deployment in mesh_deployments(overlay).items():
        env = env_of(next(containers(deployment)))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == OTLP_ENDPOINT
        assert env["OTEL_TRACES_EXPORTER"]["value"] == "otlp"
        assert env["OTEL_SERVICE_NAME"]["value"] == f"aimesh-{name}"
    (render,) = pod_spec(of_kind(overlay, "Deployment")["edge"])["initContainers"]
    assert env_of(render)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == OTLP_ENDPOINT
    # ... and the collector is there, receiving OTLP/gRPC where the pods send.
    protocol, _ = otlp_receiver(overlay, OTLP_ENDPOINT)
    assert protocol == "grpc"


def aimesh_images(docs: list[Doc]) -> set[str]:
    return {
        c["image"]
        for w in workloads(docs).values()
        for c in containers(w)
        if c["image"].split(":")[0].rsplit("/", 1)[-1] == "aimesh"
    }


def names_a_registry(image: str) -> bool:
    """Docker's rule: a first path component with a dot or a port, or localhost, is a host."""
    first, slash, _ = image.partition("/")
    return bool(slash) and (first == "localhost" or re.search(r"[.:]", first) is not None)


def test_images_are_set_by_the_overlay_and_name_no_registry(rendered):
    placeholder = load_render().IMAGE
    for overlay, docs in rendered.items():
        (image,) = aimesh_images(docs)
        assert image != placeholder, f"{overlay} leaves the base's placeholder image"
        for workload in workloads(docs).values():
            for container in containers(workload):
                assert not names_a_registry(container["image"]), container["image"]
    assert aimesh_images(rendered["cpu"]) != aimesh_images(rendered["gpu"])
    assert names_a_registry("localhost:5000/aimesh:1")
    assert not names_a_registry("qdrant/qdrant:v1.19.0")


def test_mounted_config_is_valid_and_names_every_service(overlay, deployed, monkeypatch):
    monkeypatch.setenv("AIMESH_CONFIG", str(K8S / "base" / "aimesh.toml"))
    settings = MeshSettings()
    services = of_kind(overlay, "Service")
    for name, spec in SPECS.items():
        service = settings.service(name)
        assert service.host == "0.0.0.0", name
        port = settings.port_of(name, spec.default_port)
        target = settings.target_of(name, spec.default_port)
        assert target == f"dns:///{name}.{NAMESPACE}.svc.cluster.local:{port}"
        if name in deployed:
            assert services[name]["spec"]["ports"][0]["port"] == port
    assert settings.transport.max_connection_age_s
    # Every service's table passes its own settings model; [engines] holds only the LLM
    # engine the LLM services share.
    assert options_problems(SPECS.values(), settings) == []
    assert set(settings.engines) <= {"llm"}
    llm_settings(settings)
    url = urlsplit(RetrievalSettings.of(settings, "retrieval").url)
    qdrant, namespace = url.hostname.split(".")[:2]
    assert namespace == NAMESPACE
    assert url.port in [p["port"] for p in services[qdrant]["spec"]["ports"]]


def test_llm_threads_match_the_cpus_prefill_and_decode_request(overlay, deployed):
    threads = config_toml()["engines"]["llm"]["threads"]
    for name in {"prefill", "decode"} & deployed:
        (container,) = pod_spec(of_kind(overlay, "Deployment")[name])["containers"]
        assert math.isclose(float(container["resources"]["requests"]["cpu"]), threads)


@pytest.mark.parametrize(
    "name", [name for name in OVERLAYS if "prefill" not in NOT_DEPLOYED.get(name, ())]
)
def test_prefill_advertises_its_pod_address(rendered, name):
    """KV handles name the prefill pod that holds the KV; the Service name would send a
    decoder's Pull to any prefill pod."""
    env = env_of(next(containers(of_kind(rendered[name], "Deployment")["prefill"])))
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    advertise = "AIMESH_SERVICES__PREFILL__ADVERTISE_ADDRESS"
    assert env[advertise]["value"] == f"$(POD_IP):{SPECS['prefill'].default_port}"
    # $(POD_IP) expands only if defined earlier in the list.
    assert list(env).index("POD_IP") < list(env).index(advertise)


def test_aimesh_containers_run_as_the_images_user(overlay):
    uid = int(re.search(r"^ARG UID=(\d+)$", (K8S.parent / "Dockerfile").read_text(), re.M)[1])
    for workload in workloads(overlay).values():
        pod = pod_spec(workload)
        for container in containers(workload):
            if container["image"] not in aimesh_images(overlay):
                continue
            context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert context["runAsUser"] == uid, container["name"]
            assert context["allowPrivilegeEscalation"] is False


def test_qdrant_runs_as_a_cluster(overlay):
    qdrant = of_kind(overlay, "StatefulSet")["qdrant"]
    assert qdrant["spec"]["replicas"] == 3
    headless = of_kind(overlay, "Service")[qdrant["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    (container,) = containers(qdrant)
    assert re.fullmatch(r"qdrant/qdrant:v\d+\.\d+\.\d+", container["image"])
    env = {k: v.get("value") for k, v in env_of(container).items()}
    assert env["QDRANT__CLUSTER__ENABLED"] == "true"
    p2p = int(env["QDRANT__CLUSTER__P2P__PORT"])
    assert {"name": "p2p", "containerPort": p2p} in container["ports"]
    assert p2p in [p["port"] for p in headless["spec"]["ports"]]
    script = container["args"][0]
    peers = f"{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert f'--bootstrap "http://qdrant-0.${{peers}}:{p2p}"' in script
    assert f"peers={peers}" in script
    assert '--uri "$self"' in script
    (claim,) = qdrant["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == claim["metadata"]["name"] for m in container["volumeMounts"])


def test_qdrant_and_retrieval_share_the_api_key_of_a_secret(overlay, deployed, tmp_path):
    """Qdrant answers only the key of Secret aimesh-qdrant and retrieval sends it, neither
    from the ConfigMap; Qdrant refuses to start with the committed placeholder."""
    ref = {"secretKeyRef": {"name": "aimesh-qdrant", "key": "api-key"}}
    (qdrant,) = containers(of_kind(overlay, "StatefulSet")["qdrant"])
    assert env_of(qdrant)["QDRANT__SERVICE__API_KEY"]["valueFrom"] == ref
    (retrieval,) = containers(of_kind(overlay, "Deployment")["retrieval"])
    assert env_of(retrieval)["AIMESH_SERVICES__RETRIEVAL__API_KEY"]["valueFrom"] == ref
    assert "api_key" not in config_toml()["services"]["retrieval"]
    with pytest.MonkeyPatch.context() as patch:  # the pod's environment
        patch.setenv("AIMESH_SERVICES__RETRIEVAL__API_KEY", "from-the-secret")
        patch.setenv("AIMESH_CONFIG", str(K8S / "base" / "aimesh.toml"))
        settings = MeshSettings()
    assert RetrievalSettings.of(settings, "retrieval").qdrant_key() == "from-the-secret"
    placeholder = base64.b64decode(of_kind(overlay, "Secret")["aimesh-qdrant"]["data"]["api-key"])
    script = qdrant["args"][0].replace("exec ./entrypoint.sh", "echo started")
    for key, started in ((placeholder.decode(), False), ("", False), ("a-real-key", True)):
        run = subprocess.run(
            ["/bin/sh", "-c", script],
            env={
                "PATH": os.environ["PATH"],
                "QDRANT__SERVICE__API_KEY": key,
                "HOSTNAME": "qdrant-0",
            },
            capture_output=True,
            text=True,
        )
        assert (run.returncode == 0 and "started" in run.stdout) is started, run.stderr


def test_the_production_config_turns_reflection_off():
    """Reflection would hand every caller the whole API (docs/deploy.md: grpcurl with the
    protos instead); the config the pods mount says so, and the settings read it."""
    assert config_toml()["reflection"] is False
    assert MeshSettings.model_validate(config_toml()).reflection is False


def secret_strings(value: str) -> list[str]:
    """A Secret value's credentials: each string of a JSON one (a key list), else itself."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return [value.strip()]

    def leaves(node) -> Iterator[str]:
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict | list):
            for child in node.values() if isinstance(node, dict) else node:
                yield from leaves(child)

    return list(leaves(parsed))


def settings_strings(node, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) for every string setting of a parsed config."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from settings_strings(child, f"{path}.{key}".lstrip("."))
    elif isinstance(node, list):
        for child in node:
            yield from settings_strings(child, path)


def test_no_configmap_holds_a_secret(overlay):
    """Credentials reach pods from Secrets only: no Secret's value is in any ConfigMap, the
    mesh config has no credential setting and no URL with a password in it (the Redis
    URL's is spliced in from Secret aimesh-redis), and Redis's config has no password."""
    config_maps = of_kind(overlay, "ConfigMap")
    texts = [text for c in config_maps.values() for text in c.get("data", {}).values()]
    for name, secret in of_kind(overlay, "Secret").items():
        for value in secret.get("data", {}).values():
            for credential in secret_strings(base64.b64decode(value).decode()):
                assert not any(credential in text for text in texts), name
    (mesh_config,) = (c for n, c in config_maps.items() if n.startswith("aimesh-config"))
    for key, value in settings_strings(tomllib.loads(mesh_config["data"]["aimesh.toml"])):
        assert not re.search(r"(^|[._])(api_keys?|password|secret|token)$", key), key
        assert urlsplit(value).password is None, key
    (redis_config,) = (c for n, c in config_maps.items() if n.startswith("aimesh-redis-config"))
    lines = redis_config["data"]["redis.conf"].splitlines()
    assert not {line.split()[0] for line in lines if line.strip()} & {"requirepass", "user"}
