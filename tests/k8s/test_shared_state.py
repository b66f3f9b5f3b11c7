"""The mesh's shared state in a cluster (docs/deploy.md, "Shared state"): every process
that meters tenants reads one tenants file from a mounted Secret and one Redis whose
password comes from a Secret, the agent keeps its runs in the same Redis, and that Redis
(started here as its StatefulSet starts it, on a real redis-server) answers only that
password and keeps what it is given across a restart."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from mesh.deployments import RedisStore as RedisRegistry
from mesh.deployments import open_store as open_registry
from mesh.ledger import PREFIX, Limit, RedisStore, open_store
from mesh.metering import TenantsFile
from services.agent.run_store import open_run_store
from services.agent.run_store_redis import RedisRunStore
from services.agent.settings import AgentSettings
from tests.conftest import ROOT, free_port, redis_server_binary
from tests.k8s.conftest import (
    K8S,
    NAMESPACE,
    Doc,
    containers,
    documents,
    env_of,
    kustomize,
    load_render,
    mounted_file,
    of_kind,
    pod_settings,
    pod_spec,
    secret_value,
    workloads,
)

pytestmark = pytest.mark.system

RENDER = load_render()
PASSWORD = {"secretKeyRef": {"name": "aimesh-redis", "key": "password"}}


def metering(docs: list[Doc]) -> dict[str, tuple[Doc, Doc]]:
    """Each process that meters tenants, as (workload, container): the edge's authorizer
    and the container of every service k8s/render.py names as metering."""
    deployments = of_kind(docs, "Deployment")
    edge = deployments["edge"]
    (authorizer,) = (c for c in pod_spec(edge)["containers"] if c["name"] == "authorizer")
    found = {"edge": (edge, authorizer)}
    for name in RENDER.METERED:
        (container,) = containers(deployments[name])
        found[name] = (deployments[name], container)
    return found


def redis_url(docs: list[Doc]) -> str:
    """The URL that reaches the overlay's Redis with the password of its Secret."""
    password = secret_value(docs, PASSWORD["secretKeyRef"])
    (port,) = of_kind(docs, "Service")["redis"]["spec"]["ports"]
    return f"redis://:{password}@redis.{NAMESPACE}.svc.cluster.local:{port['port']}/0"


def secret_mount(docs: list[Doc], workload: Doc, container: Doc, path: Path) -> tuple[Doc, str]:
    """The Secret `container` reads `path` from, and its text: a whole Secret directory,
    so a rotated Secret reaches the running pod."""
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent))
    assert "subPath" not in mount and mount["readOnly"], mount
    (volume,) = (v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    secret = of_kind(docs, "Secret")[volume["secret"]["secretName"]]
    return secret, base64.b64decode(secret["data"][path.name]).decode()


def test_the_services_that_meter_are_those_render_py_mounts_the_state_into():
    """A service that builds a meter and got no tenants file nor store would limit nobody
    and keep its ledger to itself: render.py's list is the code's."""
    building = {
        path.relative_to(ROOT / "services").parts[0]
        for path in (ROOT / "services").rglob("*.py")
        if "Meter.from_settings(" in path.read_text()
    }
    assert building == RENDER.METERED
    assert "Meter(" in (ROOT / "mesh" / "edge" / "authorizer.py").read_text()  # the edge


def test_every_metering_pod_reads_the_tenants_file_from_one_mounted_secret(
    overlay, monkeypatch, tmp_path
):
    """The edge's authorizer, the gateway and the generation router read [limits]
    tenants_file from the same Secret, mounted as a directory, and it is the key file of
    the doors that check keys: the keys name the tenants its tables limit."""
    secrets = set()
    for name, (workload, container) in metering(overlay).items():
        settings = pod_settings(overlay, workload, container, monkeypatch, tmp_path)
        tenants_file = settings.limits.tenants_file
        assert tenants_file is not None, name
        secret, text = secret_mount(overlay, workload, container, tenants_file)
        secrets.add(secret["metadata"]["name"])
        (tmp_path / name).write_text(text)
        assert TenantsFile(tmp_path / name).limits("anyone").requests_per_minute is None
        if name == "edge":
            assert settings.edge.api_keys_file == tenants_file
        elif name == "gateway":
            assert Path(settings.service(name).own()["api_keys_file"]) == tenants_file
    assert secrets == {RENDER.TENANTS_SECRET}


def test_an_own_overlays_secrets_reach_every_meter(tmp_path, monkeypatch):
    """docs/deploy.md's own overlay, replacing the key Secret (with a tenant's limits) and
    the Redis password: every metering pod's meter limits that tenant, in the Redis that
    password opens."""
    keys = {"keys": [], "tenants": {"acme": {"requests_per_minute": 60, "token_budget": 1000}}}
    (tmp_path / "gateway-keys.json").write_text(json.dumps(keys))
    (tmp_path / "redis-password.txt").write_text("an-own-password")
    base = os.path.relpath(K8S / "overlays" / "cpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"""
resources:
  - {base}
secretGenerator:
  - name: aimesh-gateway-keys
    namespace: aimesh
    behavior: replace
    files:
      - keys.json=gateway-keys.json
    options:
      disableNameSuffixHash: true
  - name: aimesh-redis
    namespace: aimesh
    behavior: replace
    files:
      - password=redis-password.txt
    options:
      disableNameSuffixHash: true
"""
    )
    docs = documents(kustomize(tmp_path))
    for name, (workload, container) in metering(docs).items():
        settings = pod_settings(docs, workload, container, monkeypatch, tmp_path)
        assert urlsplit(settings.limits.store).password == "an-own-password", name
        _, text = secret_mount(docs, workload, container, settings.limits.tenants_file)
        (tmp_path / name).write_text(text)
        limits = TenantsFile(tmp_path / name).limits("acme")
        assert (limits.requests_per_minute, limits.token_budget) == (60, 1000), name


def test_every_pod_that_keeps_shared_state_gets_one_redis_url_from_the_secret(
    overlay, monkeypatch, tmp_path
):
    """The meter's store of every metering process, the agent's run store and the routers'
    model registry are the one Redis of the overlay, reached with its Secret's password,
    which no pod spec spells: it is spliced in from a Secret variable defined before the
    URL."""
    url = redis_url(overlay)
    agent = of_kind(overlay, "Deployment")["agent"]
    keepers = {**metering(overlay), "agent": (agent, next(containers(agent)))}
    for name, (workload, container) in keepers.items():
        env = env_of(container)
        assert env["REDIS_PASSWORD"]["valueFrom"] == PASSWORD, name
        names = list(env)
        for setting in (
            "AIMESH_LIMITS__STORE",
            "AIMESH_SERVICES__AGENT__RUN_STORE",
            "AIMESH_DEPLOYMENTS",
        ):
            if setting in env:
                assert "$(REDIS_PASSWORD)" in env[setting]["value"], (name, setting)
                assert names.index("REDIS_PASSWORD") < names.index(setting), (name, setting)
        settings = pod_settings(overlay, workload, container, monkeypatch, tmp_path)
        if name == "agent":
            store = AgentSettings.of(settings, "agent").run_store
            assert store == url
            assert isinstance(open_run_store(store, tmp_path, 60), RedisRunStore)
        else:
            assert settings.limits.store == url, name
            assert isinstance(open_store(settings.limits.store, tmp_path), RedisStore), name
        if name == "generation":
            assert settings.deployments == url
            assert isinstance(open_registry(settings.deployments, tmp_path), RedisRegistry)
    # Only they (and Redis) hold the password.
    holders = {
        name
        for name, workload in workloads(overlay).items()
        for container in containers(workload)
        if any(e.get("valueFrom") == PASSWORD for e in container.get("env", []))
    }
    assert holders == {*keepers, "redis"}


def test_the_redis_url_reaches_the_redis_statefulset_on_a_volume(overlay):
    """The URL's Service leads to the one Redis pod, whose AOF lies on its volume claim;
    it runs as a non-root user on a read-only root filesystem, its memory bounded."""
    host = urlsplit(redis_url(overlay))
    service = of_kind(overlay, "Service")[host.hostname.split(".")[0]]
    redis_set = of_kind(overlay, "StatefulSet")["redis"]
    labels = redis_set["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert redis_set["spec"]["replicas"] == 1
    (container,) = containers(redis_set)
    (port,) = service["spec"]["ports"]
    assert {"name": port["targetPort"], "containerPort": host.port} in container["ports"]
    (claim,) = redis_set["spec"]["volumeClaimTemplates"]
    (data,) = (m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert f"dir {data['mountPath']}" in redis_config(overlay).splitlines()
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert pod_spec(redis_set)["securityContext"]["runAsNonRoot"] is True
    assert container["resources"]["limits"]["memory"]


def redis_config(docs: list[Doc]) -> str:
    redis_set = of_kind(docs, "StatefulSet")["redis"]
    (container,) = containers(redis_set)
    return mounted_file(docs, redis_set, container, "/etc/redis/redis.conf")


def directive(line: str) -> str:
    """The directive a redis.conf line sets ("" for a comment or a blank line)."""
    words = line.split()
    return words[0] if words and not words[0].startswith("#") else ""


class RedisPod:
    """The Redis container's script run here on a real redis-server, with the ConfigMap's
    redis.conf: the same file but for its port, directory and interfaces (a free port, a
    temporary directory, loopback)."""

    def __init__(self, docs: list[Doc], directory: Path) -> None:
        (self.container,) = containers(of_kind(docs, "StatefulSet")["redis"])
        self.port = free_port()
        self.directory = directory
        here = {"port": str(self.port), "dir": str(directory), "bind": "127.0.0.1"}
        lines = redis_config(docs).splitlines()
        moved = [f"{d} {here[d]}" if (d := directive(line)) in here else line for line in lines]
        assert sum(a != b for a, b in zip(lines, moved, strict=True)) == len(here)
        config = directory / "redis.conf"
        config.write_text("\n".join(moved) + "\n")
        (script,) = self.container["args"]
        self.script = script.replace("/etc/redis/redis.conf", str(config))
        bin_dir = Path(redis_server_binary()).parent
        self.path = f"{bin_dir}:{os.environ['PATH']}"

    def start(self, password: str) -> subprocess.Popen:
        """The container's command with the Secret's password in its environment; what it
        says goes to self.log."""
        self.log = self.directory / "redis.log"
        with self.log.open("w") as log:
            return subprocess.Popen(
                ["/bin/sh", "-c", self.script],
                env={"PATH": self.path, "REDISCLI_AUTH": password},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def url(self, password: str) -> str:
        return f"redis://:{password}@127.0.0.1:{self.port}/0"

    def wait_ready(self, process: subprocess.Popen, password: str) -> None:
        client = redis.Redis.from_url(self.url(password), socket_timeout=1)
        give_up = time.monotonic() + 10
        try:
            while True:  # bounded polling until it answers
                assert process.poll() is None, self.log.read_text()
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    assert time.monotonic() < give_up, "redis-server did not answer in 10 s"
                    time.sleep(0.01)
        finally:
            client.close()

    def probe(self, password: str) -> int:
        """The readiness probe's command, its redis-cli pointed at this port."""
        wrapper = self.directory / "bin"
        wrapper.mkdir(exist_ok=True)
        cli = Path(redis_server_binary()).parent / "redis-cli"
        (wrapper / "redis-cli").write_text(f'#!/bin/sh\nexec {cli} -p {self.port} "$@"\n')
        (wrapper / "redis-cli").chmod(0o755)
        command = self.container["readinessProbe"]["exec"]["command"]
        env = {"PATH": f"{wrapper}:{os.environ['PATH']}", "REDISCLI_AUTH": password}
        return subprocess.run(command, env=env, capture_output=True, timeout=10).returncode


@pytest.mark.parametrize(
    ("password", "says"),
    [
        (None, "placeholder"),  # the committed Secret's
        ("", "placeholder"),
        ("has space", "letters, digits"),
        ("p@ss/word", "letters, digits"),
        ("trailing-newline\n", "letters, digits"),
    ],
)
def test_redis_refuses_to_start_with_the_placeholder_or_a_password_a_url_cannot_carry(
    rendered, tmp_path, password, says
):
    docs = rendered["cpu"]
    if password is None:
        password = secret_value(docs, PASSWORD["secretKeyRef"])
    pod = RedisPod(docs, tmp_path)
    assert pod.start(password).wait(timeout=10) == 1
    assert says in pod.log.read_text()


def test_redis_answers_only_the_secrets_password_and_keeps_state_across_a_restart(
    rendered, tmp_path
):
    """What a metering pod's URL reaches: a Redis that refuses anyone without the password,
    is ready by its probe only with it, refuses to evict, and keeps the ledger in its AOF
    over a SIGTERM and a start."""
    docs = rendered["cpu"]
    pod = RedisPod(docs, tmp_path)
    password = "a-Real.password_0~"
    process = pod.start(password)
    try:
        pod.wait_ready(process, password)
        for url in (f"redis://127.0.0.1:{pod.port}/0", pod.url("wrong")):
            stranger = redis.Redis.from_url(url, socket_timeout=2)
            with stranger, pytest.raises(redis.AuthenticationError):
                stranger.ping()
        assert pod.probe(password) == 0
        assert pod.probe("wrong") != 0
        with redis.Redis.from_url(pod.url(password), decode_responses=True) as client:
            config = client.config_get("*")
        assert config["appendonly"] == "yes"
        assert config["maxmemory-policy"] == "noeviction"
        assert int(config["maxmemory"]) > 0

        async def settle() -> None:
            store = open_store(pod.url(password), tmp_path)
            limit = Limit("requests_per_minute", f"{PREFIX}requests:acme", 2, 2 / 60, 1)
            assert await store.take([limit]) is None
            await store.settle("s1", [], "acme", "m", {"requests": 1, "prompt_tokens": 7})
            await store.close()

        asyncio.run(settle())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        process = pod.start(password)
        pod.wait_ready(process, password)

        async def usage() -> dict:
            store = open_store(pod.url(password), tmp_path)
            try:
                return await store.usage()
            finally:
                await store.close()

        assert asyncio.run(usage())[("acme", "m")]["prompt_tokens"] == 7
    finally:
        process.kill()
        process.wait(timeout=10)
