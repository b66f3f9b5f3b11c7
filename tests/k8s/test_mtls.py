"""Mutual TLS in a cluster (k8s/components/mtls, the cpu-mtls overlay): every pod of the
mesh runs on a cert-manager certificate that names its identity, its settings read it the
way mesh/tls.py and mesh/authz.py need, the kubelet's probes reach a plaintext health port,
and the edge's Envoy reads its certificates (its mesh identity, and the one its listener
serves clients) through SDS files it can watch. cert-manager is not here: its CA issuer is
played by `issue` below, from the Certificate resources."""

from __future__ import annotations

import datetime
from pathlib import Path, PurePosixPath

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh.authz import ANYONE, EDGE, OPERATOR, identity_uri
from mesh.client import create_channel
from mesh.config import MeshSettings, TlsSettings
from mesh.edge import envoy
from mesh.registry import discover
from services.llm.kv_transfer import KV_HOLDER
from tests.harness import InProcess
from tests.k8s.conftest import Doc, containers, env_of, of_kind, pod_settings, pod_spec

# Rendered by kustomize, another project's tool: the system tier, as the other k8s tests.
pytestmark = pytest.mark.system

SPECS = discover()
OVERLAY = "cpu-mtls"
# The fields of cert-manager.io/v1 Certificate and Issuer specs these manifests may use
# (cert-manager's API reference); kubernetes-validate has no schema for its kinds.
CERTIFICATE_FIELDS = {
    "secretName", "issuerRef", "commonName", "dnsNames", "ipAddresses", "uris", "usages",
    "privateKey", "duration", "renewBefore", "isCA",
}  # fmt: skip
# The Secret of the certificate the edge's listener serves clients outside.
LISTENER_SECRET = "aimesh-edge-listener"
ISSUER_FIELDS = {"selfSigned", "ca"}


@pytest.fixture(scope="module")
def docs(rendered) -> list[Doc]:
    return rendered[OVERLAY]


def certificates(docs: list[Doc]) -> dict[str, Doc]:
    """By the Secret each Certificate fills."""
    return {c["spec"]["secretName"]: c for c in of_kind(docs, "Certificate").values()}


def tls_volume_secret(workload: Doc) -> str:
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == "tls"]
    return volume["secret"]["secretName"]


def test_certificates_come_from_the_mesh_ca_and_name_their_identity(docs):
    issuers = of_kind(docs, "Issuer")
    by_secret = certificates(docs)
    for certificate in of_kind(docs, "Certificate").values():
        spec = certificate["spec"]
        assert set(spec) <= CERTIFICATE_FIELDS, certificate["metadata"]["name"]
        assert spec["issuerRef"]["kind"] == "Issuer" and spec["issuerRef"]["name"] in issuers
    for issuer in issuers.values():
        assert set(issuer["spec"]) <= ISSUER_FIELDS
    ca = issuers["aimesh-ca"]["spec"]["ca"]["secretName"]
    assert by_secret[ca]["spec"]["isCA"] is True
    assert "selfSigned" in issuers[by_secret[ca]["spec"]["issuerRef"]["name"]]["spec"]
    leaves = [
        c for name, c in by_secret.items() if not c["spec"].get("isCA") and name != LISTENER_SECRET
    ]
    for leaf in leaves:
        assert leaf["spec"]["issuerRef"]["name"] == "aimesh-ca"
        (uri,) = leaf["spec"]["uris"]
        assert uri == identity_uri(leaf["spec"]["commonName"])
        assert {"server auth", "client auth"} <= set(leaf["spec"]["usages"])
        assert leaf["spec"]["privateKey"]["rotationPolicy"] == "Always"
    # Every name an allow-list admits has a certificate to call with.
    named = {leaf["spec"]["commonName"] for leaf in leaves}
    admitted = {c for spec in SPECS.values() for _, names in spec.callers for c in names}
    assert admitted - {ANYONE} <= named | {"echo"}  # echo: a diagnostic, not deployed
    assert {EDGE, OPERATOR} <= named


def test_each_pod_reads_its_own_certificate_and_is_probed_in_plaintext(docs, monkeypatch, tmp_path):
    by_secret = certificates(docs)
    for name, deployment in of_kind(docs, "Deployment").items():
        if name not in SPECS:
            continue
        (container,) = containers(deployment)
        certificate = by_secret[tls_volume_secret(deployment)]["spec"]
        assert certificate["uris"] == [identity_uri(name)]
        advertised = {  # what Kubernetes makes of $(POD_IP)
            n: e["value"].replace("$(POD_IP)", "10.0.0.7")
            for n, e in env_of(container).items()
            if "$(POD_IP)" in e.get("value", "")
        }
        settings = pod_settings(docs, deployment, container, monkeypatch, tmp_path, **advertised)
        tls = settings.tls
        assert tls is not None and tls.require_client_cert and tls.authorize_callers
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        for path in (tls.cert_file, tls.key_file, tls.ca_file):
            assert PurePosixPath(path).parent == PurePosixPath(mount["mountPath"])
        assert {PurePosixPath(p).name for p in (tls.cert_file, tls.key_file, tls.ca_file)} == {
            "tls.crt", "tls.key", "ca.crt"  # cert-manager's Secret keys
        }  # fmt: skip
        health = settings.port_of(name, SPECS[name].default_port) + tls.health_port_offset
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health, (name, probe)
        # What callers dial this service by is in its certificate.
        target = settings.target_of(name, SPECS[name].default_port)
        host = target.removeprefix("dns:///").rsplit(":", 1)[0]
        assert host in certificate["dnsNames"], target
    prefill = by_secret["aimesh-tls-prefill"]["spec"]
    assert KV_HOLDER in prefill["dnsNames"]  # decode dials a prefill pod by its IP


def test_the_edge_presents_its_certificate_through_files_envoy_watches(docs, monkeypatch, tmp_path):
    deployment = of_kind(docs, "Deployment")["edge"]
    (render,) = pod_spec(deployment)["initContainers"]
    proxy = {c["name"]: c for c in pod_spec(deployment)["containers"]}["envoy"]
    assert certificates(docs)[tls_volume_secret(deployment)]["spec"]["uris"] == [identity_uri(EDGE)]
    settings = pod_settings(
        docs, deployment, render, monkeypatch, tmp_path, AIMESH_EDGE__API_KEYS='["k"]'
    )
    assert settings.tls is not None
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    assert str(settings.tls.cert_file.parent) == mounts["tls"]
    assert str(settings.edge.sds_dir) == mounts["envoy-config"]  # beside envoy.yaml
    secrets = envoy.secret_documents(settings.tls, settings.edge.sds_dir)
    assert {str(path.parent) for path in secrets} == {mounts["envoy-config"]}
    # Envoy reads the 0600 files the render container writes: the same user.
    assert render["securityContext"]["runAsUser"] == proxy["securityContext"]["runAsUser"]


def test_the_edge_serves_clients_tls_on_a_certificate_of_its_own(docs, monkeypatch, tmp_path):
    """The listener's certificate names the edge Service and a port-forward's address, for
    server authentication only (no mesh identity: clients outside prove themselves by
    key); Envoy reads it by an SDS file watching its mount, serves TLS with it, and the
    kubelet probes over HTTPS."""
    deployment = of_kind(docs, "Deployment")["edge"]
    (render,) = pod_spec(deployment)["initContainers"]
    proxy = {c["name"]: c for c in pod_spec(deployment)["containers"]}["envoy"]
    listener = certificates(docs)[LISTENER_SECRET]["spec"]
    assert "uris" not in listener and "client auth" not in listener["usages"]
    assert listener["issuerRef"]["name"] == "aimesh-ca"
    assert "edge.aimesh.svc.cluster.local" in listener["dnsNames"]
    assert listener["ipAddresses"] == ["127.0.0.1"]
    settings = pod_settings(
        docs, deployment, render, monkeypatch, tmp_path, AIMESH_EDGE__API_KEYS='["k"]'
    )
    assert settings.edge.tls is not None and not settings.edge.tls_ends_in_front
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    (volume,) = [
        n for n, v in volumes.items() if v.get("secret", {}).get("secretName") == LISTENER_SECRET
    ]
    for path in (settings.edge.tls.cert_file, settings.edge.tls.key_file):
        assert str(path.parent) == mounts[volume]
    config = envoy.bootstrap(envoy.upstreams_for(list(SPECS.values()), settings), settings)
    (chain,) = config["static_resources"]["listeners"][0]["filter_chains"]
    context = chain["transport_socket"]["typed_config"]["common_tls_context"]
    (secret,) = context["tls_certificate_sds_secret_configs"]
    source = secret["sds_config"]["path_config_source"]
    assert source["watched_directory"]["path"] == mounts[volume]
    assert str(PurePosixPath(source["path"]).parent) == mounts["envoy-config"]
    assert Path(source["path"]) in envoy.sds_documents(settings)
    for probe in ("readinessProbe", "livenessProbe"):
        assert proxy[probe]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}


class CaIssuer:
    """What cert-manager's CA issuer makes of a Certificate: a leaf with its dnsNames and
    uris and nothing else (no 127.0.0.1, unlike mesh/pki.py's), as the Secret's tls.crt,
    tls.key and ca.crt."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aimesh mesh CA")])
        ca = self._sign(
            self.name, self.key, [(x509.BasicConstraints(ca=True, path_length=0), True)]
        )
        self.ca_pem = ca.public_bytes(serialization.Encoding.PEM)

    def _sign(self, subject, key, extensions) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(self.key, hashes.SHA256())

    def issue(self, certificate: Doc) -> TlsSettings:
        spec = certificate["spec"]
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(n) for n in spec["dnsNames"]]
        names += [x509.UniformResourceIdentifier(u) for u in spec["uris"]]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec["commonName"])])
        leaf = self._sign(
            subject,
            key,
            [
                (x509.SubjectAlternativeName(names), False),
                (x509.ExtendedKeyUsage(usages), False),
                (x509.BasicConstraints(ca=False, path_length=None), True),
            ],
        )
        secret = self.directory / spec["secretName"]
        secret.mkdir(parents=True)
        (secret / "tls.crt").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        (secret / "tls.key").write_bytes(private)
        (secret / "ca.crt").write_bytes(self.ca_pem)
        return TlsSettings(
            cert_file=secret / "tls.crt", key_file=secret / "tls.key", ca_file=secret / "ca.crt"
        )


async def echo(target: str, settings: MeshSettings, **channel) -> bytes:
    async with create_channel(target, settings, **channel) as opened:
        stub = echo_pb2_grpc.EchoServiceStub(opened)
        return (await stub.Echo(echo_pb2.EchoRequest(payload=b"hi"), timeout=5)).payload


@pytest.mark.service
async def test_decode_reaches_a_prefill_pod_by_its_address_on_prefills_certificate(docs, tmp_path):
    """A KV handle names a prefill pod's IP, which prefill's Certificate does not hold:
    decode's channel checks the name `prefill` instead, and gets through; checking the
    address, as a plain channel would, fails. A server on prefill's certificate stands in
    for the pod (echo: any caller of the CA may call it)."""
    issuer = CaIssuer(tmp_path)
    by_secret = certificates(docs)
    pod = MeshSettings(tls=issuer.issue(by_secret["aimesh-tls-prefill"]))
    decode = MeshSettings(tls=issuer.issue(by_secret["aimesh-tls-decode"]))
    async with InProcess() as services:
        address = (await services.start("echo", pod)).target  # 127.0.0.1:port
        assert await echo(address, decode, server_name=KV_HOLDER) == b"hi"
        with pytest.raises(grpc.aio.AioRpcError) as by_address:
            await echo(address, decode)
        assert by_address.value.code() == grpc.StatusCode.UNAVAILABLE
