"""TLS and mutual TLS between mesh processes (mesh/tls.py), with certificates from a
throwaway CA (mesh/pki.py): who may connect, and a rotated certificate taking effect
without a restart."""

from __future__ import annotations

import grpc
import pytest

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh.authz import identity_uri
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.health import probe
from mesh.pki import throwaway_pki
from mesh.tls import TlsSettings
from tests.harness import InProcess

pytestmark = pytest.mark.service


async def echo(target: str, settings: MeshSettings | None = None, **channel) -> bytes:
    """One Echo; `channel` replaces the mesh's credentials (for callers outside it)."""
    async with create_channel(target, settings or MeshSettings(), **channel) as opened:
        stub = echo_pb2_grpc.EchoServiceStub(opened)
        return (await stub.Echo(echo_pb2.EchoRequest(payload=b"hi"), timeout=5)).payload


def credentials(tls: TlsSettings, *, client_cert: bool = True) -> grpc.ChannelCredentials:
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=tls.ca_file.read_bytes())
    return grpc.ssl_channel_credentials(
        tls.ca_file.read_bytes(), tls.key_file.read_bytes(), tls.cert_file.read_bytes()
    )


async def refused(target: str, **channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await echo(target, **channel)
    return error.value.code()


async def test_only_callers_with_a_certificate_of_the_mesh_ca_get_through(tmp_path):
    mesh = throwaway_pki(tmp_path / "mesh", ["echo", "caller"])
    stranger = throwaway_pki(tmp_path / "stranger", ["caller"])["caller"]
    async with InProcess() as services:
        served = await services.start("echo", MeshSettings(tls=mesh["echo"]))
        target = served.target
        assert await echo(target, MeshSettings(tls=mesh["caller"])) == b"hi"
        assert await probe(target, "echo", tls=mesh["caller"]) == "SERVING"
        # Plaintext, another CA's certificate, the right CA but no certificate of its own.
        assert await refused(target) == grpc.StatusCode.UNAVAILABLE
        assert await probe(target, "echo") == "UNREACHABLE"
        assert await refused(target, credentials=credentials(stranger)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        no_cert = credentials(mesh["caller"], client_cert=False)
        assert await refused(target, credentials=no_cert) == grpc.StatusCode.UNAVAILABLE


async def test_a_rotated_certificate_is_served_without_a_restart(tmp_path):
    """New CA and certificates written over the server's files: new connections get
    them, so a caller of the new CA gets through and one of the old CA no longer does."""
    old = throwaway_pki(tmp_path / "pki", ["echo", "caller"])
    old_caller = TlsSettings(
        cert_file=tmp_path / "old-caller.pem",
        key_file=tmp_path / "old-caller.key",
        ca_file=tmp_path / "old-ca.pem",
    )
    for source, copy in (
        (old["caller"].cert_file, old_caller.cert_file),
        (old["caller"].key_file, old_caller.key_file),
        (old["caller"].ca_file, old_caller.ca_file),
    ):
        copy.write_bytes(source.read_bytes())
    async with InProcess() as services:
        served = await services.start("echo", MeshSettings(tls=old["echo"]))
        assert await echo(served.target, MeshSettings(tls=old_caller)) == b"hi"
        new = throwaway_pki(tmp_path / "pki", ["echo", "caller"])  # the same paths
        assert await echo(served.target, MeshSettings(tls=new["caller"])) == b"hi"
        assert await refused(served.target, credentials=credentials(old_caller)) == (
            grpc.StatusCode.UNAVAILABLE
        )


def test_each_certificate_names_its_service_for_dns_loopback_and_identity(tmp_path):
    from cryptography import x509

    tls = throwaway_pki(tmp_path, ["decode"])["decode"]
    certificate = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["decode", "localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [identity_uri("decode")]
    assert tls.key_file.stat().st_mode & 0o077 == 0


async def test_probes_without_a_certificate_reach_health_and_only_health(tmp_path):
    """[tls] health_port_offset: the kubelet's gRPC probes (no certificate) read liveness
    and readiness in plaintext on their own port, which serves nothing else; the gRPC port
    still refuses them. Draining shows NOT_SERVING there too."""
    from mesh.server import MeshServer
    from services.echo.servicer import setup
    from tests.conftest import free_port

    port, health_port = sorted((free_port(), free_port()))
    tls = throwaway_pki(tmp_path / "mesh", ["echo", "caller"])
    echo_tls = tls["echo"].model_copy(update={"health_port_offset": health_port - port})
    server = MeshServer.for_service("echo", MeshSettings(tls=echo_tls), port=port)
    await setup(server)
    await server.start()
    health = f"127.0.0.1:{health_port}"
    try:
        assert await probe(health) == "SERVING"
        assert await probe(health, "echo") == "SERVING"
        assert await probe(f"127.0.0.1:{port}", "echo") == "UNREACHABLE"  # plaintext
        assert await refused(health) == grpc.StatusCode.UNIMPLEMENTED  # no Echo there
        await server.set_ready(False)
        assert await probe(health, "echo") == "NOT_SERVING"
        assert await echo(f"127.0.0.1:{port}", MeshSettings(tls=tls["caller"])) == b"hi"
    finally:
        await server.drain(0)
    assert await probe(health) == "UNREACHABLE"


async def test_a_channel_can_ask_for_the_servers_name_instead_of_its_address(tmp_path):
    """A KV handle names a pod's own address, which no certificate holds: the channel
    checks the service's name in the certificate instead, and a server without that name
    is refused."""
    tls = throwaway_pki(tmp_path / "mesh", ["echo", "caller"])
    async with InProcess() as services:
        served = await services.start("echo", MeshSettings(tls=tls["echo"]))
        caller = MeshSettings(tls=tls["caller"])
        assert await echo(served.target, caller, server_name="echo") == b"hi"
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await echo(served.target, caller, server_name="prefill")
        assert wrong.value.code() == grpc.StatusCode.UNAVAILABLE
