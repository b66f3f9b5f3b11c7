"""TLS at the edge listener (docs/security.md), on the real Envoy with real clients.

A second Envoy, rendered by `aimesh edge render` with `[edge.tls]` naming a certificate of
a CA this module holds, fronts the `edge` fixture's mesh (the LLM stack, the embedder and
the OpenAI gateway): gRPC (ALPN h2), JSON and the `openai` SDK get through trusting that
CA; a plaintext client gets nothing, its key never reaching the key check; a renewed
certificate is served without restarting Envoy. `aimesh up --edge --tls` serves its
listener on a certificate of its own throwaway CA and says where that CA is. The config
checks need no process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from cryptography import x509
from pydantic import SecretStr

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.config import EdgeTlsSettings, MeshSettings
from mesh.edge import envoy
from mesh.edge import process as envoy_process
from mesh.edge.process import write_config
from mesh.pki import ThrowawayCa
from services.llm.artifacts import DEFAULT_NAME
from tests.conftest import (
    ROOT,
    VENV_BIN,
    free_port,
    running_mesh,
    start_mesh,
    subprocess_env,
    wait_accepting,
)
from tests.edge.conftest import API_KEY, SERVICES, Edge
from tests.edge.test_config import assert_envoy_accepts, edge_config

AUTH = (("authorization", f"Bearer {API_KEY}"),)
LISTENER = "edge-listener"
HOSTS = ["127.0.0.1", "localhost"]
EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
GATEWAY_KEY = "sk-everything"  # the gateway checks its own keys (tests/edge/conftest.py)
EMBED = embedder_pb2.EmbedRequest(inputs=["a cat sat on the mat"])


@dataclass
class TlsEdge:
    port: int
    admin_port: int
    ca: ThrowawayCa  # signs the listener's certificate, and its renewals
    tls: EdgeTlsSettings
    access_log: Path  # Envoy's stdout: one JSON line per request
    process: asyncio.subprocess.Process

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def logged(self, marker: str) -> list[dict]:
        """The access log's lines for requests whose user agent holds `marker`."""
        lines = self.access_log.read_text().splitlines()
        return [json.loads(line) for line in lines if marker in line and line.startswith("{")]


async def logged(edge: TlsEdge, marker: str, count: int) -> list[dict]:
    """The access log's lines for `marker` once there are `count` of them (Envoy flushes
    its access log about once a second); 30 s allows a loaded machine."""
    give_up = asyncio.get_running_loop().time() + 30
    while len(lines := edge.logged(marker)) < count:
        assert asyncio.get_running_loop().time() < give_up, f"{len(lines)} of {count} logged"
        await asyncio.sleep(0.1)
    return lines


def client_context(ca_file: Path, alpn: list[str] | None = None) -> ssl.SSLContext:
    """What a client outside holds: the CA to check the edge by, nothing of its own."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


def credentials(ca_file: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())


async def handshake(
    port: int, ca_file: Path, server_name: str = "127.0.0.1", alpn: list[str] | None = None
) -> tuple[x509.Certificate, str | None]:
    """The certificate the listener serves, checked against `ca_file` for `server_name`
    (the handshake fails otherwise), and the protocol ALPN settled on."""
    _, writer = await asyncio.open_connection(
        "127.0.0.1",
        port,
        ssl=client_context(ca_file, alpn or ["h2", "http/1.1"]),
        server_hostname=server_name,
    )
    try:
        connection = writer.get_extra_info("ssl_object")
        served = x509.load_der_x509_certificate(connection.getpeercert(binary_form=True))
        return served, connection.selected_alpn_protocol()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


def serial_of(cert_file: Path) -> int:
    return x509.load_pem_x509_certificate(cert_file.read_bytes()).serial_number


async def envoy_stat(admin_port: int, name: str) -> int:
    async with httpx.AsyncClient(timeout=10) as client:
        reply = await client.get(f"http://127.0.0.1:{admin_port}/stats", params={"filter": name})
    values = [line.rsplit(":", 1)[1] for line in reply.text.splitlines() if line]
    return sum(int(value) for value in values)


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def tls_edge(edge: Edge, tmp_path_factory) -> AsyncIterator[TlsEdge]:
    """Envoy with [edge.tls] in front of the `edge` fixture's services, configured by
    `aimesh edge render` and with its key checker (`aimesh edge authorize`) beside it, as a
    deployment runs them."""
    directory = tmp_path_factory.mktemp("tls-edge")
    ca = ThrowawayCa(directory / "pki")
    tls = ca.listener(LISTENER, HOSTS)
    port, admin_port, authorizer_port = free_port(), free_port(), free_port()
    env = subprocess_env(
        AIMESH_EDGE__PORT=str(port),
        AIMESH_EDGE__ADMIN_PORT=str(admin_port),
        AIMESH_EDGE__AUTHORIZER_PORT=str(authorizer_port),
        AIMESH_EDGE__METRICS_PORT="0",
        AIMESH_EDGE__API_KEYS=f'["{API_KEY}"]',
        AIMESH_EDGE__API_KEYS_FILE=str(edge.keys),
        AIMESH_EDGE__TLS__CERT_FILE=str(tls.cert_file),
        AIMESH_EDGE__TLS__KEY_FILE=str(tls.key_file),
        AIMESH_SERVICES__GATEWAY__HTTP_PORT=str(edge.http_port),
        AIMESH_SERVICES__GATEWAY__API_KEYS_FILE=str(edge.keys),
        **{f"AIMESH_SERVICES__{name.upper()}__PORT": str(p) for name, p in edge.ports.items()},
    )
    aimesh = str(VENV_BIN / "aimesh")
    config = directory / "envoy.json"
    only = [arg for name in SERVICES for arg in ("--only", name)]
    render = await asyncio.create_subprocess_exec(
        aimesh, "edge", "render", *only, "--out", str(config),
        env=env, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert await render.wait() == 0
    checker_log = directory / "authorizer.log"
    with checker_log.open("wb") as output:
        checker = await asyncio.create_subprocess_exec(
            aimesh, "edge", "authorize", env=env, stdout=output, stderr=output
        )
    access_log = directory / "envoy.log"
    proxy = await envoy_process.start(str(VENV_BIN / "envoy"), config, access_log)
    try:
        await wait_accepting(authorizer_port, checker, checker_log)
        if not await envoy_process.wait_ready(proxy, admin_port, timeout_s=60):
            raise AssertionError(f"envoy did not become ready:\n{access_log.read_text()}")
        yield TlsEdge(port, admin_port, ca, tls, access_log, proxy)
    finally:
        await envoy_process.stop(proxy)
        await envoy_process.stop(checker)


@pytest.mark.system
async def test_grpc_over_tls_trusting_the_ca_negotiates_h2(tls_edge: TlsEdge):
    """A unary call and a server stream with the CA as root certificates, by address and
    by the name `localhost`; Envoy logs them as HTTP/2 over TLS, and a bare handshake
    offering h2 and http/1.1 settles on h2 (ALPN)."""
    marker = secrets.token_hex(8)
    options = [("grpc.primary_user_agent", marker)]
    by_name = [*options, ("grpc.ssl_target_name_override", "localhost")]
    for channel_options in (options, by_name):
        async with grpc.aio.secure_channel(
            tls_edge.target, credentials(tls_edge.ca.ca_file), options=channel_options
        ) as channel:
            embedded = await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
                EMBED, metadata=AUTH, timeout=60
            )
            stream = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                generation_pb2.GenerateRequest(
                    prompt="The capital of France is",
                    sampling=sampling_pb2.SamplingParameters(temperature=0),
                    stopping=sampling_pb2.StoppingCriteria(max_new_tokens=4),
                ),
                metadata=AUTH,
                timeout=120,
            )
            replies = [reply async for reply in stream]
        assert len(embedded.embeddings) == 1 and embedded.embeddings[0].values
        assert replies[-1].HasField("complete")
    lines = await logged(tls_edge, marker, 4)
    assert len(lines) == 4, lines
    assert {(line["protocol"], line["tls"]) for line in lines} == {("HTTP/2", "TLSv1.3")}
    _, protocol = await handshake(tls_edge.port, tls_edge.ca.ca_file, alpn=["h2", "http/1.1"])
    assert protocol == "h2"
    _, protocol = await handshake(tls_edge.port, tls_edge.ca.ca_file, alpn=["http/1.1"])
    assert protocol == "http/1.1"


@pytest.mark.system
async def test_json_over_tls_with_httpx_on_http11_and_h2(tls_edge: TlsEdge):
    context = client_context(tls_edge.ca.ca_file)
    headers = dict(AUTH)
    for http2 in (False, True):
        async with httpx.AsyncClient(
            base_url=tls_edge.url, verify=context, http2=http2, headers=headers, timeout=60
        ) as client:
            reply = await client.post("/v1/embed", json={"inputs": ["hello"]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["embeddings"][0]["values"]
        assert reply.http_version == ("HTTP/2" if http2 else "HTTP/1.1")


@pytest.mark.system
async def test_the_openai_sdk_reaches_the_gateway_over_tls(tls_edge: TlsEdge):
    """The SDK as a user configures it for a private CA: an https base_url and an httpx
    client that trusts the CA."""
    http_client = httpx.AsyncClient(verify=client_context(tls_edge.ca.ca_file), timeout=120)
    async with openai.AsyncOpenAI(
        base_url=f"{tls_edge.url}/v1", api_key=GATEWAY_KEY, http_client=http_client, max_retries=0
    ) as client:
        names = [model.id for model in (await client.models.list()).data]
        vectors = await client.embeddings.create(model=EMBEDDING_MODEL, input=["a cat"])
        stream = await client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert {DEFAULT_NAME, EMBEDDING_MODEL} <= set(names)
    assert len(vectors.data[0].embedding) == 384
    assert text.strip()


@pytest.mark.system
async def test_plaintext_gets_nothing_and_its_key_never_reaches_the_check(tls_edge: TlsEdge):
    """gRPC, httpx and raw HTTP/1.1 in plaintext, each with a valid key: no answer, no
    request Envoy ever parsed (so no key check, no access log line), only failed
    handshakes. A TLS request logged after them shows the log was written meanwhile."""
    failed_before = await envoy_stat(tls_edge.admin_port, "ssl.connection_error")
    marker = secrets.token_hex(8)
    async with grpc.aio.insecure_channel(
        tls_edge.target, options=[("grpc.primary_user_agent", marker)]
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
                EMBED, metadata=AUTH, timeout=30
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.TransportError):
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(
                f"http://{tls_edge.target}/v1/embed",
                headers={**dict(AUTH), "user-agent": marker},
                json={"inputs": ["hello"]},
            )
    reader, writer = await asyncio.open_connection("127.0.0.1", tls_edge.port)
    body = b'{"inputs": ["hello"]}'
    writer.write(
        b"POST /v1/embed HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {API_KEY}\r\nuser-agent: {marker}\r\n".encode()
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(), timeout=30)
    except ConnectionError:
        answer = b""
    finally:
        writer.close()
    assert not answer.startswith(b"HTTP/"), answer[:200]
    after = secrets.token_hex(8)
    async with httpx.AsyncClient(
        verify=client_context(tls_edge.ca.ca_file), headers={**dict(AUTH), "user-agent": after}
    ) as client:
        assert (await client.post(f"{tls_edge.url}/v1/embed", json={"inputs": ["x"]})).is_success
    await logged(tls_edge, after, 1)
    assert tls_edge.logged(marker) == []
    assert await envoy_stat(tls_edge.admin_port, "ssl.connection_error") >= failed_before + 3


@pytest.mark.system
async def test_aimesh_models_reaches_a_tls_edge_trusting_its_ca(tls_edge: TlsEdge):
    """An operator's `aimesh models --edge` over TLS with `--edge-ca`; without it, the
    plaintext call gets nothing from the TLS listener (and its key is never read)."""

    def models(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV_BIN / "aimesh"), "models", "list", "--edge", tls_edge.target, *extra],
            env=subprocess_env(AIMESH_API_KEY=API_KEY, OTEL_TRACES_EXPORTER="none"),
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = await asyncio.to_thread(models, "--edge-ca", str(tls_edge.ca.ca_file))
    assert listed.returncode == 0, listed.stderr
    assert "model" in listed.stdout and "active" in listed.stdout
    plain = await asyncio.to_thread(models, "--timeout", "10")
    assert plain.returncode != 0
    assert "UNAVAILABLE" in plain.stderr or "DEADLINE_EXCEEDED" in plain.stderr, plain.stderr


@pytest.mark.system
async def test_a_renewed_certificate_is_served_without_restarting_envoy(tls_edge: TlsEdge):
    """The listener's files rewritten (moved in, as a Secret's swap or os.replace does)
    with a new key and certificate of the same CA: Envoy, the same process, serves the new
    serial, and clients that trust the CA go on as before."""
    old = serial_of(tls_edge.tls.cert_file)
    served, _ = await handshake(tls_edge.port, tls_edge.ca.ca_file)
    assert served.serial_number == old
    renewed = tls_edge.ca.listener(LISTENER, HOSTS)
    assert renewed == tls_edge.tls and serial_of(renewed.cert_file) != old
    give_up = asyncio.get_running_loop().time() + 30
    while (await handshake(tls_edge.port, tls_edge.ca.ca_file))[0].serial_number == old:
        assert asyncio.get_running_loop().time() < give_up, "Envoy still serves the old one"
        await asyncio.sleep(0.1)
    served, _ = await handshake(tls_edge.port, tls_edge.ca.ca_file, server_name="localhost")
    assert served.serial_number == serial_of(renewed.cert_file)
    assert tls_edge.process.returncode is None
    async with grpc.aio.secure_channel(tls_edge.target, credentials(tls_edge.ca.ca_file)) as ch:
        await embedder_pb2_grpc.EmbedderServiceStub(ch).Embed(EMBED, metadata=AUTH, timeout=60)


@pytest.mark.system
async def test_up_with_tls_serves_the_edge_on_its_ca_and_says_where_it_is(tmp_path):
    """`aimesh up --edge --tls`: the listener's certificate comes from the throwaway CA
    (ca.pem in --tls-dir, which up names), for 127.0.0.1 and localhost; a gRPC client
    trusting it gets through to the embedder (reached over mutual TLS), and so does
    grpcurl with -cacert (the demo's); plaintext not."""
    pki = tmp_path / "pki"
    edge_port, embedder_port = free_port(), free_port()
    env = subprocess_env(
        AIMESH_EDGE__PORT=str(edge_port),
        AIMESH_EDGE__ADMIN_PORT=str(free_port()),
        AIMESH_EDGE__AUTHORIZER_PORT=str(free_port()),
        AIMESH_EDGE__METRICS_PORT="0",
        AIMESH_EDGE__API_KEYS=f'["{API_KEY}"]',
        AIMESH_SERVICES__EMBEDDER__PORT=str(embedder_port),
        AIMESH_SERVICES__EMBEDDER__METRICS_PORT="0",
    )
    async with running_mesh(
        "--only", "embedder", "--edge", "--tls", "--tls-dir", str(pki),
        "--log-dir", str(tmp_path / "logs"), env=env,
    ) as said:  # fmt: skip
        ca_file = pki / "ca.pem"
        assert f"clients trust the CA {ca_file}" in said.decode()
        assert f"https://127.0.0.1:{edge_port}" in said.decode()
        for name in HOSTS:
            served, _ = await handshake(edge_port, ca_file, server_name=name)
            assert served.serial_number == serial_of(pki / f"{LISTENER}.pem")
        target = f"127.0.0.1:{edge_port}"
        async with grpc.aio.secure_channel(target, credentials(ca_file)) as channel:
            embedded = await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
                EMBED, metadata=AUTH, timeout=60
            )
        assert embedded.embeddings[0].values
        grpcurl = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "grpcurl"), "-cacert", str(ca_file),
            "-H", f"authorization: Bearer {API_KEY}",
            "-import-path", str(ROOT / "protos"),
            "-import-path", str(ROOT / "third_party" / "googleapis"),
            "-proto", "aimesh/retrieval/v1/embedder.proto", "-d", '{"inputs": ["hi"]}',
            target, "aimesh.retrieval.v1.EmbedderService/Embed",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(grpcurl.communicate(), timeout=60)
        assert grpcurl.returncode == 0 and b'"values"' in output, output.decode()
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
                    EMBED, metadata=AUTH, timeout=30
                )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.system
async def test_up_refuses_a_plaintext_edge_beyond_loopback_before_starting_anything(tmp_path):
    env = subprocess_env(
        AIMESH_EDGE__HOST="0.0.0.0",
        AIMESH_EDGE__API_KEYS=f'["{API_KEY}"]',
        AIMESH_SERVICES__EMBEDDER__PORT=str(free_port()),
    )
    up = await start_mesh(
        "--only", "embedder", "--edge", "--log-dir", str(tmp_path), env=env,
        output=asyncio.subprocess.PIPE,
    )  # fmt: skip
    said, _ = await asyncio.wait_for(up.communicate(), timeout=120)
    assert up.returncode == 2, said.decode()
    assert "edge.tls_ends_in_front" in said.decode() and "[edge.tls]" in said.decode()
    assert not (tmp_path / "embedder.log").exists()


@pytest.fixture
def settings() -> MeshSettings:
    settings = MeshSettings()
    settings.edge.api_keys = [SecretStr("k")]
    return settings


def listeners_of(config: dict) -> dict[str, dict]:
    return {listener["name"]: listener for listener in config["static_resources"]["listeners"]}


@pytest.mark.unit
def test_with_edge_tls_the_listener_serves_its_certificate_by_sds(settings, tmp_path):
    """[edge.tls]: the listener's one filter chain ends TLS (1.2 at least) on the certificate
    an SDS file names, reloaded when a file moves into the certificate's directory; ALPN
    offers h2 and http/1.1; no client certificate is asked for. The real Envoy takes it."""
    settings.edge.tls = EdgeTlsSettings(
        cert_file=tmp_path / "listener" / "tls.crt", key_file=tmp_path / "listener" / "tls.key"
    )
    settings.edge.sds_dir = tmp_path / "edge"
    config = edge_config(settings)
    (chain,) = listeners_of(config)["edge"]["filter_chains"]
    context = chain["transport_socket"]["typed_config"]
    assert context["@type"].endswith("DownstreamTlsContext")
    assert not context.get("require_client_certificate")
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2", "http/1.1"]
    assert common["tls_params"]["tls_minimum_protocol_version"] == "TLSv1_2"
    (secret,) = common["tls_certificate_sds_secret_configs"]
    source = secret["sds_config"]["path_config_source"]
    assert source["watched_directory"]["path"] == str(tmp_path / "listener")
    documents = envoy.sds_documents(settings)
    (resource,) = documents[Path(source["path"])]["resources"]
    assert resource["name"] == secret["name"]
    assert resource["tls_certificate"] == {
        "certificate_chain": {"filename": str(settings.edge.tls.cert_file)},
        "private_key": {"filename": str(settings.edge.tls.key_file)},
    }
    ca = ThrowawayCa(tmp_path / "pki")  # real files, for Envoy's validation
    settings.edge.tls = ca.listener(LISTENER, HOSTS)
    path = write_config(
        edge_config(settings), tmp_path / "edge" / "envoy.json", envoy.sds_documents(settings)
    )
    assert_envoy_accepts(path)


@pytest.mark.unit
def test_a_plaintext_listener_beyond_loopback_is_the_operators_explicit_choice(settings, tmp_path):
    """Plaintext on loopback (aimesh up's default); beyond it only with
    tls_ends_in_front (a proxy in front ends the clients' TLS), else refused, naming both
    ways out. With [edge.tls] any host is served TLS."""
    assert "transport_socket" not in listeners_of(edge_config(settings))["edge"]["filter_chains"][0]
    settings.edge.host = "0.0.0.0"
    with pytest.raises(ValueError, match=r"\[edge\.tls\].*edge\.tls_ends_in_front"):
        edge_config(settings)
    settings.edge.tls_ends_in_front = True
    assert "transport_socket" not in listeners_of(edge_config(settings))["edge"]["filter_chains"][0]
    settings.edge.tls_ends_in_front = False
    settings.edge.tls = EdgeTlsSettings(cert_file=tmp_path / "c.pem", key_file=tmp_path / "k.pem")
    with pytest.raises(ValueError, match="sds_dir"):
        edge_config(settings)
    settings.edge.sds_dir = tmp_path
    assert "transport_socket" in listeners_of(edge_config(settings))["edge"]["filter_chains"][0]


@pytest.mark.unit
def test_with_tls_no_plaintext_listener_reaches_a_service(settings, tmp_path):
    """Beside the TLS listener only Prometheus' is plaintext, and it routes to Envoy's own
    stats alone: no key is ever taken in clear text."""
    settings.edge.tls = ThrowawayCa(tmp_path).listener(LISTENER, HOSTS)
    settings.edge.sds_dir = tmp_path / "edge"
    listeners = listeners_of(edge_config(settings))
    assert set(listeners) == {"edge", "metrics"}
    (chain,) = listeners["metrics"]["filter_chains"]
    manager = chain["filters"][0]["typed_config"]
    routes = [r for host in manager["route_config"]["virtual_hosts"] for r in host["routes"]]
    assert [r["route"]["cluster"] for r in routes] == [envoy.ADMIN_CLUSTER]
    assert "transport_socket" in listeners["edge"]["filter_chains"][0]


@pytest.mark.unit
def test_edge_render_writes_the_listeners_sds_file_or_says_what_is_missing(tmp_path):
    """`aimesh edge render` with [edge.tls] writes the listener's SDS file beside the
    config, its owner's only; beyond loopback without TLS it exits 2 naming the choice."""
    ca = ThrowawayCa(tmp_path / "pki")
    tls = ca.listener(LISTENER, HOSTS)
    out = tmp_path / "edge" / "envoy.yaml"

    def render(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV_BIN / "aimesh"), "edge", "render", "--only", "embedder", "--out", str(out)],
            env=subprocess_env(AIMESH_EDGE__API_KEYS='["k"]', AIMESH_EDGE__HOST="0.0.0.0", **env),
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = render()
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "edge.tls_ends_in_front" in refused.stdout and "[edge.tls]" in refused.stdout
    written = render(
        AIMESH_EDGE__TLS__CERT_FILE=str(tls.cert_file), AIMESH_EDGE__TLS__KEY_FILE=str(tls.key_file)
    )
    assert written.returncode == 0, written.stdout + written.stderr
    secret = out.parent / f"{envoy.LISTENER_SECRET}.json"
    assert secret.stat().st_mode & 0o777 == 0o600
    (resource,) = json.loads(secret.read_text())["resources"]
    assert resource["tls_certificate"]["private_key"]["filename"] == str(tls.key_file)
    assert_envoy_accepts(out)


@pytest.mark.unit
def test_the_throwaway_listener_certificate_names_its_hosts_for_servers_only(tmp_path):
    ca = ThrowawayCa(tmp_path)
    tls = ca.listener(LISTENER, [*HOSTS, "10.0.0.7", "edge.example.test"])
    certificate = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.7"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "edge.example.test"]
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == []  # no mesh identity
    usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    assert tls.key_file.stat().st_mode & 0o777 == 0o600
