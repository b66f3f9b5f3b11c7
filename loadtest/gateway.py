"""What the OpenAI-compatible gateway costs: the same generation straight to the router
over gRPC and through Envoy and the gateway as server-sent events, in one run,
alternating, against one `aimesh up --edge` (the LLM stack, the embedder, the gateway).

Scenarios: a streamed completion of at most 16 tokens (greedy) at 1 and 8 concurrent
streams: time to the first text, the gap between text chunks, aggregate tokens/s (each
request's own completion_tokens); and one short embedding at concurrency 1 (calls/s).
Then, alone: clients that go away mid-stream, and how long until decode's slot
(GetLoad) and its KV cache (aimesh_llm_kv_cache_usage_perc) are free again. Beside the
wall-clock numbers, which two shared cores make noisy, the CPU each process spends per
token at eight streams through the gateway: on a machine the mesh already fills, the
gateway path's share of that is what it takes from direct throughput.
The gateway's client is httpx reading the raw event stream, so the SDK's own parsing is
not counted against the gateway.

    python -m loadtest.gateway --seconds 5 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import re
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import psutil

from aimesh.llm.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
)
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from loadtest.edge import free_port
from loadtest.mesh_overhead import write
from mesh.edge.process import wait_ready
from mesh.health import wait_until_serving

SERVICES = ("generation", "tokenizer", "prefill", "decode", "embedder", "gateway")
KEY = "bench-key"
PROMPT = "Write a short story about a lighthouse keeper:"
TOKENS = 16
MODEL = "SmolLM2-135M-Instruct"
EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
BEGIN, END = "<!-- gateway:begin -->", "<!-- gateway:end -->"
DISCONNECTS = 10


@dataclass
class Sample:
    seconds: float = 0.0
    calls: int = 0
    tokens: int = 0
    first: list[float] = field(default_factory=list)  # to the first text, seconds
    gaps: list[float] = field(default_factory=list)  # between text chunks, seconds

    def rate(self, unit: str) -> float:
        return (self.tokens if unit == "tokens/s" else self.calls) / self.seconds

    @staticmethod
    def p50(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2] * 1000 if ordered else float("nan")


# One call: (seconds to the first text, gaps between text chunks, completion tokens).
Call = Callable[[], Awaitable[tuple[float, list[float], int]]]


async def measure(call: Call, concurrency: int, seconds: float, sample: Sample) -> None:
    await call()  # warm: connections, the first prefill
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            first, gaps, tokens = await call()
            sample.first.append(first)
            sample.gaps += gaps
            sample.tokens += tokens
            sample.calls += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    sample.seconds += time.perf_counter() - started


def _timed(started: float, arrivals: list[float]) -> tuple[float, list[float]]:
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return (arrivals[0] - started if arrivals else float("nan")), gaps


def grpc_generate(stub: generation_pb2_grpc.GenerationServiceStub) -> Call:
    request = generation_pb2.GenerateRequest(
        prompt=PROMPT,
        sampling=sampling_pb2.SamplingParameters(temperature=0),
        stopping=sampling_pb2.StoppingCriteria(max_new_tokens=TOKENS),
    )

    async def call() -> tuple[float, list[float], int]:
        started, arrivals, tokens = time.perf_counter(), [], 0
        async for message in stub.Generate(request, timeout=120):
            if message.HasField("chunk") and message.chunk.text:
                arrivals.append(time.perf_counter())
            elif message.HasField("complete"):
                tokens = message.complete.usage.completion_tokens
        return (*_timed(started, arrivals), tokens)

    return call


def sse_generate(http: httpx.AsyncClient) -> Call:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def call() -> tuple[float, list[float], int]:
        started, arrivals, tokens = time.perf_counter(), [], 0
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return (*_timed(started, arrivals), tokens)

    return call


def grpc_embed(stub: embedder_pb2_grpc.EmbedderServiceStub) -> Call:
    request = embedder_pb2.EmbedRequest(inputs=[PROMPT])

    async def call() -> tuple[float, list[float], int]:
        started = time.perf_counter()
        await stub.Embed(request, timeout=30)
        return time.perf_counter() - started, [], 0

    return call


def http_embed(http: httpx.AsyncClient) -> Call:
    body = {"model": EMBEDDER, "input": [PROMPT], "encoding_format": "float"}

    async def call() -> tuple[float, list[float], int]:
        started = time.perf_counter()
        (await http.post("/v1/embeddings", json=body)).raise_for_status()
        return time.perf_counter() - started, [], 0

    return call


@dataclass
class Freed:
    """Milliseconds from a client's disconnect until decode's slot and KV were free."""

    slot_ms: list[float] = field(default_factory=list)
    kv_ms: list[float] = field(default_factory=list)


async def disconnects(http: httpx.AsyncClient, decode: grpc.aio.Channel, metrics: str) -> Freed:
    """Streams a long chat, reads a few events, goes away; polls until decode let go."""
    stub = decode_pb2_grpc.DecodeServiceStub(decode)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count slowly from one to five hundred."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }

    async def running() -> int:
        return (await stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=5)).running

    async def kv_in_use() -> float:
        text = (await http.get(metrics)).text
        return float(re.search(r"^aimesh_llm_kv_cache_usage_perc (\S+)$", text, re.M)[1])

    freed = Freed()
    for _ in range(DISCONNECTS):
        reply = await http.send(
            http.build_request("POST", "/v1/chat/completions", json=body), stream=True
        )
        events = (line async for line in reply.aiter_lines() if line)
        for _ in range(5):  # the role, then text: decode is under way
            await anext(events)
        assert await running() == 1 and await kv_in_use() > 0
        gone = time.perf_counter()
        await reply.aclose()
        slot = kv = None
        while slot is None or kv is None:
            if slot is None and await running() == 0:
                slot = (time.perf_counter() - gone) * 1000
            if kv is None and await kv_in_use() == 0:
                kv = (time.perf_counter() - gone) * 1000
            assert time.perf_counter() - gone < 10, "decode still busy 10 s after a disconnect"
        freed.slot_ms.append(slot)
        freed.kv_ms.append(kv)
    return freed


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}


def mesh_processes(up: int) -> dict[str, psutil.Process]:
    """`aimesh up`'s children by service name, Envoy as "envoy"."""
    found = {}
    for child in psutil.Process(up).children(recursive=True):
        command = child.cmdline()
        if command[-2:-1] == ["serve"]:
            found[command[-1]] = child
        elif any("envoy" in part for part in command[:1]):
            found["envoy"] = child
    return found


async def run(
    seconds: float, rounds: int
) -> tuple[dict[tuple[str, str], Sample], Freed, dict[str, float]]:
    ports = {name: free_port() for name in SERVICES}
    http_port, edge_port, admin_port = free_port(), free_port(), free_port()
    decode_metrics = free_port()
    env = {
        **os.environ,
        "AIMESH_LOG_LEVEL": "WARNING",
        "AIMESH_EDGE__PORT": str(edge_port),
        "AIMESH_EDGE__ADMIN_PORT": str(admin_port),
        "AIMESH_EDGE__AUTHORIZER_PORT": str(free_port()),
        "AIMESH_EDGE__METRICS_PORT": "0",
        "AIMESH_EDGE__RATE_LIMIT_PER_S": "1000000",
        "AIMESH_EDGE__RATE_LIMIT_BURST": "1000000",
        "AIMESH_EDGE__API_KEYS": f'["{KEY}"]',
        "AIMESH_SERVICES__GATEWAY__HTTP_PORT": str(http_port),
        **{f"AIMESH_SERVICES__{n.upper()}__PORT": str(p) for n, p in ports.items()},
        **{f"AIMESH_SERVICES__{n.upper()}__METRICS_PORT": "0" for n in SERVICES},
        "AIMESH_SERVICES__DECODE__METRICS_PORT": str(decode_metrics),
    }
    only = [arg for name in SERVICES for arg in ("--only", name)]
    up = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh.cli", "up", *only, "--edge", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    samples: dict[tuple[str, str], Sample] = {}
    cpu: dict[tuple[str, str], float] = {}  # (path, process) -> seconds at eight streams
    try:
        for name, port in ports.items():
            assert await wait_until_serving(f"127.0.0.1:{port}", name, 300), name
        assert await wait_ready(up, admin_port, 60), "envoy"
        processes = {**mesh_processes(up.pid), "client": psutil.Process()}
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{ports['generation']}") as generation,
            grpc.aio.insecure_channel(f"127.0.0.1:{ports['embedder']}") as embedder,
            grpc.aio.insecure_channel(f"127.0.0.1:{ports['decode']}") as decode,
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{edge_port}",
                headers={"authorization": f"Bearer {KEY}"},
                timeout=120,
                limits=limits,
            ) as http,
        ):
            paths = {
                "gRPC direct": (
                    grpc_generate(generation_pb2_grpc.GenerationServiceStub(generation)),
                    grpc_embed(embedder_pb2_grpc.EmbedderServiceStub(embedder)),
                ),
                "gateway via Envoy": (sse_generate(http), http_embed(http)),
            }
            for _ in range(rounds):  # alternate round by round: drift hits both alike
                for path, (generate, embed) in paths.items():
                    for scenario, call, concurrency, share in (
                        ("stream, 1 client", generate, 1, 2),
                        ("stream, 8 clients", generate, 8, 2),
                        ("embed one sentence", embed, 1, 1),
                    ):
                        sample = samples.setdefault((scenario, path), Sample())
                        counted = concurrency == 8
                        before = cpu_seconds(processes) if counted else {}
                        await measure(call, concurrency, seconds * share, sample)
                        for name, spent in cpu_seconds(processes).items() if counted else ():
                            key = (path, name)
                            cpu[key] = cpu.get(key, 0.0) + spent - before[name]
            freed = await disconnects(http, decode, f"http://127.0.0.1:{decode_metrics}/metrics")
    finally:
        up.send_signal(signal.SIGTERM)
        await up.wait()
    return samples, freed, cpu


def report(
    samples: dict[tuple[str, str], Sample],
    freed: Freed,
    cpu: dict[tuple[str, str], float],
    seconds: float,
    rounds: int,
) -> str:
    lines = [
        BEGIN,
        "## The OpenAI-compatible gateway: gRPC direct vs the gateway through Envoy",
        "",
        f"Command: `python -m loadtest.gateway --seconds {seconds:g} --rounds {rounds}`"
        f" (`make bench-gateway`). Machine: {os.cpu_count()} cores, Python"
        f" {platform.python_version()}. One `aimesh up --edge` (generation, tokenizer,"
        " prefill, decode, embedder, gateway, Envoy); the client is a separate process;"
        f" at most {TOKENS} tokens, greedy; the paths alternate round by round.",
        "",
        "| scenario | path | calls/s | first text p50 (ms) | chunk gap p50 (ms) | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    summary = []
    for scenario in dict.fromkeys(key[0] for key in samples):
        for path in ("gRPC direct", "gateway via Envoy"):
            s = samples[(scenario, path)]
            tokens = f"{s.tokens / s.seconds:,.1f}" if s.tokens else "-"
            gaps = f"{Sample.p50(s.gaps):.1f}" if s.gaps else "-"
            lines.append(
                f"| {scenario} | {path} | {s.calls / s.seconds:,.1f} |"
                f" {Sample.p50(s.first):.1f} | {gaps} | {tokens} |"
            )
        direct = samples[(scenario, "gRPC direct")]
        gateway = samples[(scenario, "gateway via Envoy")]
        unit = "tokens/s" if direct.tokens else "calls/s"
        kept = gateway.rate(unit) / direct.rate(unit)
        summary.append(
            f"- {scenario}: the gateway keeps {kept:.0%} of direct {unit}; first text p50"
            f" {Sample.p50(gateway.first) - Sample.p50(direct.first):+.1f} ms"
        )
    summary.append(
        f"- a client that goes away mid-stream ({DISCONNECTS} times, through Envoy): decode's"
        f" slot free after p50 {statistics.median(freed.slot_ms):.0f} ms (max"
        f" {max(freed.slot_ms):.0f}), its KV after p50 {statistics.median(freed.kv_ms):.0f} ms"
        f" (max {max(freed.kv_ms):.0f})"
    )
    for path in ("gRPC direct", "gateway via Envoy"):
        tokens = samples[("stream, 8 clients", path)].tokens
        per_token = {
            name: spent / tokens * 1000 for (on, name), spent in sorted(cpu.items()) if on == path
        }
        mesh = sum(ms for name, ms in per_token.items() if name != "client")
        added = per_token.get("gateway", 0.0) + per_token.get("envoy", 0.0)
        summary.append(
            f"- CPU per token, eight streams, {path}: "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in per_token.items() if ms >= 0.05)
            + (
                f"; the gateway and Envoy are {added / mesh:.1%} of the mesh's"
                if path == "gateway via Envoy"
                else ""
            )
        )
    lines += ["", *summary, END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    samples, freed, cpu = asyncio.run(run(args.seconds, args.rounds))
    markdown = report(samples, freed, cpu, args.seconds, args.rounds)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
