"""What Envoy at the edge costs: the same calls straight to the service and through Envoy,
in one run, alternating, against one `aimesh up --edge` (embedder and the LLM stack); and
what TLS at the edge costs: the same unary calls through a second Envoy, rendered the same
way in front of the same services and authorizer, whose listener serves TLS ([edge.tls]).

Scenarios: Embed (one short sentence, gRPC) at concurrency 1 and 8; the same Embed as JSON
through the edge (no direct JSON exists: it shows what transcoding adds over edge gRPC);
a streamed Generate (16 tokens, greedy): time to first chunk and to the end, direct and
through the plaintext edge.

    python -m loadtest.edge --seconds 5 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import socket
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from loadtest.mesh_overhead import write
from mesh.edge import process as edge_process
from mesh.health import wait_until_serving
from mesh.pki import ThrowawayCa

SERVICES = ("embedder", "generation", "tokenizer", "prefill", "decode")
KEY = "bench-key"
METADATA = (("authorization", f"Bearer {KEY}"),)
SENTENCE = "How do I copy a nested list in Python?"
BEGIN, END = "<!-- edge:begin -->", "<!-- edge:end -->"
ONLY = [arg for name in SERVICES for arg in ("--only", name)]
ROUTES = ("direct", "edge", "edge TLS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Route:
    """How the load reaches the services: straight to each, or through one of the edges."""

    name: str
    edge: str | None = None  # the edge's host:port; None: each service's own port
    ca_file: Path | None = None  # TLS to the edge, trusting this CA

    def channel(self, service_target: str) -> grpc.aio.Channel:
        target = self.edge or service_target
        if self.ca_file is None:
            return grpc.aio.insecure_channel(target)
        credentials = grpc.ssl_channel_credentials(self.ca_file.read_bytes())
        return grpc.aio.secure_channel(target, credentials)

    def http(self) -> httpx.AsyncClient:
        if self.ca_file is None:
            return httpx.AsyncClient(base_url=f"http://{self.edge}")
        verify = ssl.create_default_context(cafile=str(self.ca_file))
        return httpx.AsyncClient(base_url=f"https://{self.edge}", verify=verify)


@dataclass
class Sample:
    calls: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # streams: time to the first chunk

    def p(self, q: float, values: list[float] | None = None) -> float:
        ordered = sorted(self.latencies if values is None else values)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000


async def measure(
    call: Callable[[], Awaitable[float | None]], concurrency: int, seconds: float, sample: Sample
) -> None:
    for _ in range(5):
        await call()
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            first = await call()
            sample.latencies.append(time.perf_counter() - started)
            if first is not None:
                sample.first.append(first - started)
            sample.calls += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    sample.seconds += time.perf_counter() - started


async def run(seconds: float, rounds: int) -> dict[tuple[str, str], Sample]:
    ports = {name: free_port() for name in SERVICES}
    edge_port, admin_port = free_port(), free_port()
    env = {
        **os.environ,
        "AIMESH_LOG_LEVEL": "WARNING",
        "AIMESH_EDGE__PORT": str(edge_port),
        "AIMESH_EDGE__ADMIN_PORT": str(admin_port),
        "AIMESH_EDGE__AUTHORIZER_PORT": str(free_port()),
        "AIMESH_EDGE__METRICS_PORT": "0",
        # The benchmark is the load: the edge's rate limit must not shape it.
        "AIMESH_EDGE__RATE_LIMIT_PER_S": "1000000",
        "AIMESH_EDGE__RATE_LIMIT_BURST": "1000000",
        "AIMESH_EDGE__API_KEYS": f'["{KEY}"]',
        **{f"AIMESH_SERVICES__{n.upper()}__PORT": str(p) for n, p in ports.items()},
        **{f"AIMESH_SERVICES__{n.upper()}__METRICS_PORT": "0" for n in SERVICES},
    }
    up = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh.cli", "up", *ONLY, "--edge", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    samples: dict[tuple[str, str], Sample] = {}
    try:
        for name, port in ports.items():
            assert await wait_until_serving(f"127.0.0.1:{port}", name, 300), name
        assert await edge_process.wait_ready(up, admin_port, 60), "envoy"
        with tempfile.TemporaryDirectory() as directory:
            tls_edge, tls_route = await start_tls_edge(env, Path(directory))
            routes = [Route("direct"), Route("edge", f"127.0.0.1:{edge_port}"), tls_route]
            try:
                for _ in range(rounds):  # alternate routes round by round: drift hits all alike
                    for route in routes:
                        await scenarios(route, ports, seconds, samples)
            finally:
                await edge_process.stop(tls_edge)
    finally:
        up.send_signal(signal.SIGTERM)
        await up.wait()
    return samples


async def start_tls_edge(
    env: dict[str, str], directory: Path
) -> tuple[asyncio.subprocess.Process, Route]:
    """A second Envoy, rendered by `aimesh edge render` as any edge is, in front of the
    same services and asking the same authorizer, its listener on a P-256 certificate of
    a throwaway CA ([edge.tls])."""
    ca = ThrowawayCa(directory / "pki")
    listener = ca.listener("edge-listener", ["127.0.0.1"])
    port, admin_port = free_port(), free_port()
    config = directory / "envoy.json"
    render = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh.cli", "edge", "render", *ONLY, "--out", str(config),
        env={
            **env,
            "AIMESH_EDGE__PORT": str(port),
            "AIMESH_EDGE__ADMIN_PORT": str(admin_port),
            "AIMESH_EDGE__TLS__CERT_FILE": str(listener.cert_file),
            "AIMESH_EDGE__TLS__KEY_FILE": str(listener.key_file),
        },
        stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert await render.wait() == 0, "edge render"
    proxy = await edge_process.start("envoy", config, directory / "envoy.log")
    if not await edge_process.wait_ready(proxy, admin_port, 60):
        await edge_process.stop(proxy)
        raise AssertionError("the Envoy with TLS did not become ready")
    return proxy, Route("edge TLS", f"127.0.0.1:{port}", ca.ca_file)


async def scenarios(route: Route, ports, seconds, samples) -> None:
    metadata = METADATA if route.edge else ()
    async with (
        route.channel(f"127.0.0.1:{ports['embedder']}") as embed_channel,
        route.channel(f"127.0.0.1:{ports['generation']}") as generate_channel,
    ):
        embedder = embedder_pb2_grpc.EmbedderServiceStub(embed_channel)
        generation = generation_pb2_grpc.GenerationServiceStub(generate_channel)
        request = embedder_pb2.EmbedRequest(inputs=[SENTENCE])

        async def embed() -> None:
            await embedder.Embed(request, metadata=metadata, timeout=30)

        async def generate() -> float:
            first = 0.0
            stream = generation.Generate(
                generation_pb2.GenerateRequest(
                    prompt=SENTENCE,
                    sampling=sampling_pb2.SamplingParameters(temperature=0),
                    # Always 16 tokens: a greedy answer may otherwise end at once.
                    stopping=sampling_pb2.StoppingCriteria(max_new_tokens=16, ignore_eos=True),
                ),
                metadata=metadata,
                timeout=60,
            )
            async for _ in stream:
                first = first or time.perf_counter()
            return first

        # A generation takes seconds here: it gets more time, or p50 rests on a few calls.
        # TLS costs a stream's chunks what it costs a unary call: its time goes to those.
        measured = [("embed gRPC", embed, 1, 1), ("embed gRPC", embed, 8, 1)]
        if route.ca_file is None:
            measured.append(("generate 16 tokens", generate, 1, 4))
        for name, call, concurrency, share in measured:
            sample = samples.setdefault((f"{name}, c={concurrency}", route.name), Sample())
            await measure(call, concurrency, seconds * share, sample)
    if route.edge:
        async with route.http() as http:

            async def embed_json() -> None:
                reply = await http.post(
                    "/v1/embed", json={"inputs": [SENTENCE]}, headers={"x-api-key": KEY}
                )
                reply.raise_for_status()

            sample = samples.setdefault(("embed JSON, c=1", route.name), Sample())
            await measure(embed_json, 1, seconds, sample)


def report(samples: dict[tuple[str, str], Sample], seconds: float, rounds: int) -> str:
    lines = [
        BEGIN,
        "## Edge: straight to the service vs through Envoy, in plaintext and over TLS",
        "",
        f"Command: `python -m loadtest.edge --seconds {seconds:g} --rounds {rounds}`"
        f" (`make bench-edge`). Machine: {os.cpu_count()} cores, Python"
        f" {platform.python_version()}. One `aimesh up --edge` (embedder, generation,"
        " tokenizer, prefill, decode, Envoy asking its key-checking authorizer (ext_authz) about"
        " every request, health checks, transcoder, buffer limits, access"
        " logs) and a second Envoy rendered the same way in front of the same services and"
        " authorizer, its listener on TLS ([edge.tls]: TLS 1.3, a P-256 certificate; each"
        " client keeps its connection, so a handshake is paid once); the client is a separate"
        " process; direct, edge and edge TLS alternate round by round.",
        "",
        "| scenario | path | calls/s | p50 (ms) | p99 (ms) | first chunk p50 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    summary = []
    for scenario in dict.fromkeys(key[0] for key in samples):
        for path in ROUTES:
            s = samples.get((scenario, path))
            if s is None:
                continue
            first = f"{s.p(0.5, s.first):.1f}" if s.first else "-"
            lines.append(
                f"| {scenario} | {path} | {s.calls / s.seconds:,.1f} | {s.p(0.5):.2f} |"
                f" {s.p(0.99):.2f} | {first} |"
            )
        direct, edge = samples.get((scenario, "direct")), samples.get((scenario, "edge"))
        if direct and edge:
            kept = (edge.calls / edge.seconds) / (direct.calls / direct.seconds)
            summary.append(
                f"- {scenario}: the edge keeps {kept:.0%} of direct throughput, p50"
                f" {edge.p(0.5) - direct.p(0.5):+.2f} ms"
                + (
                    f", first chunk {edge.p(0.5, edge.first) - direct.p(0.5, direct.first):+.2f} ms"
                    if edge.first
                    else ""
                )
            )
        plain, tls = edge, samples.get((scenario, "edge TLS"))
        if plain and tls:
            kept = (tls.calls / tls.seconds) / (plain.calls / plain.seconds)
            summary.append(
                f"- {scenario}: TLS at the edge keeps {kept:.0%} of the plaintext edge's"
                f" throughput, p50 {tls.p(0.5) - plain.p(0.5):+.2f} ms"
            )
    json_edge = samples.get(("embed JSON, c=1", "edge"))
    grpc_edge = samples.get(("embed gRPC, c=1", "edge"))
    if json_edge and grpc_edge:
        summary.append(
            f"- JSON through the edge vs gRPC through the edge (c=1): p50"
            f" {json_edge.p(0.5) - grpc_edge.p(0.5):+.2f} ms, median of"
            f" {statistics.median(json_edge.latencies) * 1000:.2f} ms"
        )
    lines += ["", *summary, END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    samples = asyncio.run(run(args.seconds, args.rounds))
    markdown = report(samples, args.seconds, args.rounds)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
