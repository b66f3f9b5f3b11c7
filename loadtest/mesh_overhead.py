"""What the mesh stack costs per call: bare grpc.aio vs the full aimesh stack, same run.

Both sides serve the same minimal echo servicer in a separate process; only the stack
differs. Bare: grpc.aio.server() and grpc.aio.insecure_channel(). Mesh: MeshServer
(tracing with a batch span processor, request id, deadline, metrics, error table,
admission) and mesh.client.create_channel (tracing, request id, deadline, breaker,
retry service config). Mesh-untraced: the same with OTEL_SDK_DISABLED=true, which
removes the OpenTelemetry interceptors, to show what tracing costs on its own.
Mesh-mtls: the full stack over mutual TLS with caller authorization (certificates of a
throwaway CA, mesh/pki.py), to show what `[tls]` costs per hop. Mesh-tokens: plaintext
with a signed caller token per call instead (`[tls] caller_tokens`, as behind sidecars
that end TLS: mesh/caller_token.py), to show what proving the caller that way costs.
Scenarios: unary at
concurrency 1 and 32, server streaming (100 messages per call) at concurrency 1 and 32.

    python -m loadtest.mesh_overhead --seconds 5 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh import tracing
from mesh.client import create_channel
from mesh.config import MeshSettings, ServiceSettings, TlsSettings
from mesh.health import wait_until_serving
from mesh.pki import throwaway_pki
from mesh.server import MeshServer

STREAM_MESSAGES = 100
PAYLOAD = b"x" * 64
SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]
BEGIN, END = "<!-- mesh_overhead:begin -->", "<!-- mesh_overhead:end -->"


class BenchEcho(echo_pb2_grpc.EchoServiceServicer):
    """The same trivial work on both sides, so the difference is the stack alone."""

    async def Echo(self, request, context):
        return echo_pb2.EchoResponse(payload=request.payload)

    async def EchoStream(self, request, context) -> AsyncIterator[echo_pb2.EchoStreamResponse]:
        for index in range(request.count):
            yield echo_pb2.EchoStreamResponse(index=index, payload=PAYLOAD)


class _Discard(SpanExporter):
    """Spans are created, batched and handed to an exporter; only the network is skipped."""

    def export(self, spans: Sequence) -> SpanExportResult:
        return SpanExportResult.SUCCESS


STACKS = ("bare", "mesh", "mesh-untraced", "mesh-mtls", "mesh-tokens")
CLIENT_IDENTITY = "bench-client"


def stack_settings(stack: str, pki: Path, identity: str) -> MeshSettings:
    """`identity`'s settings on `stack`: its certificate from `pki` for mesh-mtls, and for
    mesh-tokens to sign with."""
    if stack == "mesh-mtls":
        return MeshSettings(tls=certificate_of(pki, identity))
    if stack == "mesh-tokens":
        tls = certificate_of(pki, identity).model_copy(update={"caller_tokens": True})
        return MeshSettings(tls=tls)
    return MeshSettings()


def certificate_of(pki: Path, identity: str) -> TlsSettings:
    return TlsSettings(
        cert_file=pki / f"{identity}.pem", key_file=pki / f"{identity}.key", ca_file=pki / "ca.pem"
    )


async def serve(stack: str, port: int, pki: Path) -> None:
    if stack == "bare":
        server = grpc.aio.server()
        echo_pb2_grpc.add_EchoServiceServicer_to_server(BenchEcho(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
        return
    tracing.configure("bench-server", processor=BatchSpanProcessor(_Discard()))
    settings = stack_settings(stack, pki, "echo")
    settings.services = {"echo": ServiceSettings(max_concurrency=64)}
    callers = [(SERVICE.full_name, (CLIENT_IDENTITY,))]
    mesh_server = MeshServer("echo", settings, port=port, callers=callers)
    mesh_server.add_service(echo_pb2_grpc.add_EchoServiceServicer_to_server, BenchEcho(), SERVICE)
    await mesh_server.serve_until_signal()


@dataclass
class Result:
    stack: str
    scenario: str
    concurrency: int
    calls: int
    messages: int
    seconds: float
    latencies: list[float]

    @property
    def rps(self) -> float:
        return self.calls / self.seconds

    @property
    def messages_per_s(self) -> float:
        return self.messages / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def load(
    stack: str, target: str, scenario: str, concurrency: int, seconds: float, pki: Path
) -> Result:
    if stack == "bare":
        channel = grpc.aio.insecure_channel(target)
    else:
        settings = stack_settings(stack, pki, CLIENT_IDENTITY)
        channel = create_channel(target, settings, services=[SERVICE])
    stub = echo_pb2_grpc.EchoServiceStub(channel)
    latencies: list[float] = []
    messages = 0

    async def one_call() -> int:
        if scenario == "unary":
            await stub.Echo(echo_pb2.EchoRequest(payload=PAYLOAD), timeout=10)
            return 1
        count = 0
        async for _ in stub.EchoStream(
            echo_pb2.EchoStreamRequest(count=STREAM_MESSAGES), timeout=10
        ):
            count += 1
        return count

    # The previous stack's server just exited on this port; grpc's global subchannel pool
    # may still hold that connection in backoff, so the first call waits for a new one.
    await stub.Echo(echo_pb2.EchoRequest(), timeout=30, wait_for_ready=True)
    for _ in range(50):  # warm up connections and caches alike
        await one_call()
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal messages
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            received = await one_call()
            latencies.append(time.perf_counter() - started)
            messages += received

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await channel.close()
    return Result(stack, scenario, concurrency, len(latencies), messages, elapsed, latencies)


def start_server(stack: str, port: int, pki: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadtest.mesh_overhead",
            "--serve",
            stack,
            "--port",
            str(port),
            "--pki",
            str(pki),
        ],
        env={**os.environ, "GRPC_VERBOSITY": "ERROR", "AIMESH_LOG_LEVEL": "WARNING"},
    )


async def run(seconds: float, rounds: int, port: int, pki: Path) -> list[Result]:
    tracing.configure("bench-client", processor=BatchSpanProcessor(_Discard()))
    throwaway_pki(pki, ["echo", CLIENT_IDENTITY])
    results: list[Result] = []
    scenarios = [("unary", 1), ("unary", 32), ("stream", 1), ("stream", 32)]
    # Alternate stacks round by round so drift on a noisy machine hits both alike.
    for _ in range(rounds):
        for stack in STACKS:
            # Read by mesh.tracing in the server process and in this one's channels.
            os.environ["OTEL_SDK_DISABLED"] = "true" if stack == "mesh-untraced" else "false"
            server = start_server(stack, port, pki)
            try:
                target = f"127.0.0.1:{port}"
                if stack != "bare":
                    tls = stack_settings(stack, pki, CLIENT_IDENTITY).tls
                    assert await wait_until_serving(target, "echo", timeout_s=30, tls=tls)
                else:
                    await _wait_listening(target)
                for scenario, concurrency in scenarios:
                    result = await load(stack, target, scenario, concurrency, seconds, pki)
                    results.append(result)
            finally:
                server.terminate()
                server.wait(timeout=30)
    return results


async def _wait_listening(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)


def merge(results: list[Result]) -> dict[tuple[str, str, int], Result]:
    merged: dict[tuple[str, str, int], Result] = {}
    for r in results:
        key = (r.stack, r.scenario, r.concurrency)
        if key in merged:
            m = merged[key]
            m.calls += r.calls
            m.messages += r.messages
            m.seconds += r.seconds
            m.latencies += r.latencies
        else:
            merged[key] = Result(**{**r.__dict__, "latencies": list(r.latencies)})
    return merged


def report(results: list[Result], seconds: float, rounds: int) -> str:
    merged = merge(results)
    us = 1e6
    lines = [
        BEGIN,
        "## Mesh overhead: bare grpc.aio vs the full aimesh stack",
        "",
        f"Command: `python -m loadtest.mesh_overhead --seconds {seconds:g} --rounds {rounds}`"
        f" (`make bench`). Machine: {os.cpu_count()} cores, Python {platform.python_version()},"
        f" grpcio {grpc.__version__}; server and load generator are separate processes on"
        " 127.0.0.1. Full stack = tracing (spans batched to a discarding exporter),"
        " request id, deadline, metrics, error table, admission on the server; tracing,"
        " request id, deadline, breaker and retry config on the client. Mesh-untraced ="
        " the same with OTEL_SDK_DISABLED=true. Mesh-mtls = the full stack over mutual TLS"
        " (EC P-256 certificates) with caller authorization. Mesh-tokens = plaintext with"
        " a signed caller token (ES256 JWT) checked against the allow-list per call, as"
        " behind sidecars that end TLS. Stacks alternate round by round.",
        "",
        "| scenario | concurrency | stack | calls/s | msgs/s | p50 (us) | p99 (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for scenario, concurrency in [("unary", 1), ("unary", 32), ("stream", 1), ("stream", 32)]:
        bare = merged[("bare", scenario, concurrency)]
        for r in (merged[(stack, scenario, concurrency)] for stack in STACKS):
            lines.append(
                f"| {scenario} | {concurrency} | {r.stack} | {r.rps:,.0f} | "
                f"{r.messages_per_s:,.0f} | {r.percentile(0.5) * us:,.0f} | "
                f"{r.percentile(0.99) * us:,.0f} |"
            )
        for stack in STACKS[1:]:
            other = merged[(stack, scenario, concurrency)]
            kept = other.messages_per_s / bare.messages_per_s
            added = (other.percentile(0.5) - bare.percentile(0.5)) * us
            summary.append(
                f"- {scenario}, c={concurrency}, {stack}: keeps {kept:.0%} of bare throughput;"
                f" p50 {added:+,.0f} us per call"
            )
        plain = merged[("mesh", scenario, concurrency)]
        for stack, what in (("mesh-mtls", "mTLS"), ("mesh-tokens", "caller tokens")):
            secured = merged[(stack, scenario, concurrency)]
            summary.append(
                f"- {scenario}, c={concurrency}, {what} against the plaintext mesh: keeps"
                f" {secured.messages_per_s / plain.messages_per_s:.0%} of its throughput; p50"
                f" {(secured.percentile(0.5) - plain.percentile(0.5)) * us:+,.0f} us per call"
            )
    lines += ["", *summary, END]
    return "\n".join(lines)


def write(markdown: str, out: Path) -> None:
    """Replaces this benchmark's section (between its markers) or appends it."""
    begin, end = markdown.splitlines()[0], markdown.splitlines()[-1]
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    if begin in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + markdown + tail
    else:
        text = text.rstrip() + "\n\n" + markdown + "\n"
    out.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", choices=STACKS)
    parser.add_argument("--port", type=int, default=50900)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pki", type=Path, help="(internal) certificates: mesh-mtls, mesh-tokens")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.port, args.pki))
        return
    with tempfile.TemporaryDirectory() as pki:
        results = asyncio.run(run(args.seconds, args.rounds, args.port, Path(pki)))
    markdown = report(results, args.seconds, args.rounds)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
