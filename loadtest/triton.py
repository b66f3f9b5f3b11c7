"""The embedder's three execution backends, one run: in-process torch, in-process ONNX
Runtime, and Triton Inference Server, each behind its own `aimesh serve embedder`.

What a client of the embedder gets is what differs, so the calls go through the service:
three embedder processes, alike but for `[services.embedder] backend`, on free ports, and
one real Triton (loadtest/triton_server.py) serving only the sentence_embedding model, the
same exported ONNX graph the onnx backend runs, on ONNX Runtime inside Triton's Python
backend. Tokenizing and micro-batching stay in the embedder for all three. Scenarios: one
short sentence per request, and 32 stdlib docstring paragraphs per request (truncated at
256 tokens), each at concurrency 1 and 8. Cells interleave, the backends' order rotating
round by round, so the machine's noise hits all three alike. Triton's own statistics split
its time per pass into queueing and computing, which is what a GPU would shrink.

    python -m loadtest.triton --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform
import secrets
import sys
import tempfile
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import astuple, dataclass
from functools import cache
from itertools import cycle
from pathlib import Path

import grpc
import numpy as np
import onnxruntime
import tritonclient.grpc.aio as triton_aio

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from loadtest.edge import SENTENCE, Sample, free_port, measure
from loadtest.embed import corpus, embedder_env
from loadtest.mesh_overhead import write
from loadtest.triton_server import ADMIN_HEADER, TritonServer, prepare_repository, triton_venv
from mesh.config import MeshSettings
from mesh.health import wait_until_serving

BEGIN, END = "<!-- triton:begin -->", "<!-- triton:end -->"
BACKENDS = ("onnx", "torch", "triton")  # the first is the ratios' reference
REFERENCE = BACKENDS[0]
MODEL = "sentence_embedding"
# The benchmark's own server reads its statistics and model config, admin protocols.
ADMIN_KEY = secrets.token_hex(16)
ADMIN = {ADMIN_HEADER: ADMIN_KEY}
BATCH = 32
CALL_TIMEOUT_S = 60
EmbedCall = Callable[[list[str]], Awaitable[np.ndarray]]


@dataclass(frozen=True)
class Scenario:
    """One request shape at one concurrency: a cell per backend and round."""

    name: str
    texts: int  # per request
    concurrency: int
    # Of --seconds per round: a request of 32 paragraphs takes most of a second here, so
    # it gets more time, or its p99 rests on a handful of calls.
    share: float

    @property
    def label(self) -> str:
        return f"{self.name}, c={self.concurrency}"


SCENARIOS = (
    Scenario("1 sentence", 1, 1, 1.0),
    Scenario("1 sentence", 1, 8, 1.0),
    Scenario(f"{BATCH} paragraphs", BATCH, 1, 2.0),
    Scenario(f"{BATCH} paragraphs", BATCH, 8, 2.0),
)


@dataclass
class TritonTime:
    """What Triton spent on the model during some embedder requests: its statistics'
    difference around them, nanoseconds."""

    requests: int = 0  # to the embedder, warm-up calls included
    passes: int = 0  # ModelInfer calls: the embedder sends one per padded pass
    queue_ns: int = 0
    compute_ns: int = 0  # input + execute + output: the part a GPU would run

    def __add__(self, other: TritonTime) -> TritonTime:
        return TritonTime(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def per_pass_ms(self, ns: int) -> float:
        return ns / max(self.passes, 1) / 1e6


@dataclass
class Results:
    samples: dict[tuple[Scenario, str], Sample]
    triton: dict[Scenario, TritonTime]
    min_cosine: dict[str, float]  # against the reference backend, over every text sent
    versions: dict[str, str]


@cache
def payloads(texts: int) -> list[list[str]]:
    """What one request carries: the sentence, or consecutive 32-paragraph slices of
    loadtest.embed's corpus, so requests differ in length as real ones do."""
    if texts == 1:
        return [[SENTENCE]]
    paragraphs = corpus()
    return [paragraphs[start : start + texts] for start in range(0, len(paragraphs), texts)]


@asynccontextmanager
async def triton_server(work: Path) -> AsyncIterator[TritonServer]:
    """Triton with only the sentence_embedding model (the repository's others would load
    for nothing), its artifact linked in as a deployment places it."""
    venv = await asyncio.to_thread(triton_venv)
    await asyncio.to_thread(prepare_repository, work / "models", MeshSettings().cache_dir, [MODEL])
    server = TritonServer(venv, work / "models", work, free_port(), admin_key=ADMIN_KEY)
    server.start()
    try:
        await server.wait_ready(MODEL)
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def triton_embedder_env(backend: str, port: int, triton_url: str) -> dict[str, str]:
    env = embedder_env(backend, port)
    if backend == "triton":
        env["AIMESH_SERVICES__EMBEDDER__TRITON__URL"] = triton_url
        env["AIMESH_SERVICES__EMBEDDER__TRITON__MODEL"] = MODEL
    return env


async def start_embedder(backend: str, triton_url: str, logs: Path) -> tuple[Process, str]:
    """`aimesh serve embedder` on `backend`, logging to `logs`; the process, its target."""
    port = free_port()
    aimesh = Path(sys.executable).parent / "aimesh"
    env = triton_embedder_env(backend, port, triton_url)
    with (logs / f"embedder-{backend}.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            str(aimesh), "serve", "embedder", env=env, stderr=log
        )
    return process, f"127.0.0.1:{port}"


@asynccontextmanager
async def embedders(triton_url: str, logs: Path) -> AsyncIterator[dict[str, str]]:
    """One embedder per backend, loading side by side; their targets."""
    targets: dict[str, str] = {}
    processes: list[Process] = []
    try:
        for backend in BACKENDS:
            process, targets[backend] = await start_embedder(backend, triton_url, logs)
            processes.append(process)
        for backend, target in targets.items():
            if not await wait_until_serving(target, "embedder", timeout_s=300):
                log = (logs / f"embedder-{backend}.log").read_text()[-3000:]
                raise SystemExit(f"the {backend} embedder did not start:\n{log}")
        yield targets
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
        for process in processes:
            await process.wait()


def embed_call(stub: embedder_pb2_grpc.EmbedderServiceStub) -> EmbedCall:
    async def embed(texts: list[str]) -> np.ndarray:
        request = embedder_pb2.EmbedRequest(inputs=texts, truncate=True)
        response = await stub.Embed(request, timeout=CALL_TIMEOUT_S)
        return np.array([e.values for e in response.embeddings], dtype=np.float32)

    return embed


async def agreement(calls: dict[str, EmbedCall]) -> dict[str, float]:
    """Every text of both scenarios once through each backend (their first calls, too):
    the lowest cosine of each backend's normalised vectors against the reference's."""
    sizes = dict.fromkeys(scenario.texts for scenario in SCENARIOS)
    texts = [payload for size in sizes for payload in payloads(size)]
    vectors = {
        backend: np.concatenate([await call(payload) for payload in texts])
        for backend, call in calls.items()
    }
    reference = vectors[REFERENCE]
    return {b: float((v * reference).sum(axis=1).min()) for b, v in vectors.items()}


async def triton_spent(
    client: triton_aio.InferenceServerClient, work: Awaitable[int]
) -> TritonTime:
    """Triton's statistics' difference around `work`, which returns the requests it sent."""
    before = await _statistics(client)
    requests = await work
    after = await _statistics(client)
    return TritonTime(requests, *(a - b for a, b in zip(after, before, strict=True)))


async def _statistics(client: triton_aio.InferenceServerClient) -> tuple[int, int, int]:
    """The model's cumulative passes, queue and compute nanoseconds. Compute comes from
    the per-execution statistics: the per-request ones charge every request of a dynamic
    batch the whole execution, counting it once per request."""
    (model,) = (await client.get_inference_statistics(MODEL, headers=ADMIN)).model_stats
    compute = sum(
        batch.compute_input.ns + batch.compute_infer.ns + batch.compute_output.ns
        for batch in model.batch_stats
    )
    return model.inference_stats.success.count, model.inference_stats.queue.ns, compute


def rotated(round_index: int) -> tuple[str, ...]:
    """The backends in a different order each round: none always runs first or last."""
    shift = round_index % len(BACKENDS)
    return BACKENDS[shift:] + BACKENDS[:shift]


async def cell(call: EmbedCall, scenario: Scenario, seconds: float, sample: Sample) -> int:
    """One scenario on one backend for its share of `seconds`; the requests it sent."""
    requests = cycle(payloads(scenario.texts))
    sent = 0

    async def one() -> None:
        nonlocal sent
        sent += 1
        await call(next(requests))

    await measure(one, scenario.concurrency, seconds * scenario.share, sample)
    return sent


async def interleaved(
    calls: dict[str, EmbedCall],
    stats: triton_aio.InferenceServerClient,
    seconds: float,
    rounds: int,
) -> tuple[dict[tuple[Scenario, str], Sample], dict[Scenario, TritonTime]]:
    """Every scenario on every backend, cell after cell, `rounds` times."""
    samples: dict[tuple[Scenario, str], Sample] = {}
    spent = {scenario: TritonTime() for scenario in SCENARIOS}
    for round_index in range(rounds):
        for scenario in SCENARIOS:
            for backend in rotated(round_index):
                sample = samples.setdefault((scenario, backend), Sample())
                work = cell(calls[backend], scenario, seconds, sample)
                if backend == "triton":
                    spent[scenario] += await triton_spent(stats, work)
                else:
                    await work
    return samples, spent


async def run(seconds: float, rounds: int) -> Results:
    """Triton, the three embedders and the measurements, all torn down after."""
    with tempfile.TemporaryDirectory(prefix="aimesh-bench-triton-") as work:
        async with AsyncExitStack() as stack:
            triton = await stack.enter_async_context(triton_server(Path(work)))
            targets = await stack.enter_async_context(embedders(triton.url, Path(work)))
            stats = await stack.enter_async_context(triton_aio.InferenceServerClient(triton.url))
            calls = {}
            for backend, target in targets.items():
                channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
                calls[backend] = embed_call(embedder_pb2_grpc.EmbedderServiceStub(channel))
            runtimes = await versions(triton, stats)
            cosines = await agreement(calls)
            samples, spent = await interleaved(calls, stats, seconds, rounds)
    return Results(samples, spent, cosines, runtimes)


async def versions(
    triton: TritonServer, client: triton_aio.InferenceServerClient
) -> dict[str, str]:
    """This environment's runtimes, Triton's, the ONNX Runtime its Python backend imports,
    and how Triton runs the model, as its repository configures it."""
    site = triton.env["PYTHONPATH"]
    (triton_onnxruntime,) = importlib.metadata.distributions(name="onnxruntime", path=[site])
    config = (await client.get_model_config(MODEL, headers=ADMIN)).config
    instances = sum(group.count for group in config.instance_group)
    delay_ms = config.dynamic_batching.max_queue_delay_microseconds / 1000
    return {
        "torch": importlib.metadata.version("torch"),
        "onnxruntime": onnxruntime.__version__,
        "triton": (await client.get_server_metadata()).version,
        "triton onnxruntime": triton_onnxruntime.version,
        "triton model": f"instances: {instances}, dynamic batching within {delay_ms:g} ms",
    }


def rate(sample: Sample) -> float:
    return sample.calls / sample.seconds


def rows(results: Results) -> Iterator[str]:
    for scenario in SCENARIOS:
        reference = results.samples[scenario, REFERENCE]
        for backend in BACKENDS:
            s = results.samples[scenario, backend]
            yield (
                f"| {scenario.label} | {backend} | {s.calls} | {rate(s):,.1f} |"
                f" {rate(s) * scenario.texts:,.1f} | {s.p(0.5):,.1f} | {s.p(0.99):,.1f} |"
                f" {rate(s) / rate(reference):.2f}x | {s.p(0.5) / reference.p(0.5):.2f}x |"
            )


def triton_rows(results: Results) -> Iterator[str]:
    for scenario in SCENARIOS:
        t = results.triton[scenario]
        yield (
            f"| {scenario.label} | {t.passes / t.requests:.1f} | {t.per_pass_ms(t.queue_ns):,.2f} |"
            f" {t.per_pass_ms(t.compute_ns):,.2f} | {t.compute_ns / t.requests / 1e6:,.1f} |"
            f" {results.samples[scenario, 'triton'].p(0.5):,.1f} |"
        )


def report(results: Results, seconds: float, rounds: int) -> str:
    v = results.versions
    cosines = ", ".join(f"{b} {c:.6f}" for b, c in results.min_cosine.items() if b != REFERENCE)
    lines = [
        BEGIN,
        "## Execution backends: in-process torch vs ONNX Runtime vs Triton",
        "",
        f"Command: `python -m loadtest.triton --seconds {seconds:g} --rounds {rounds}"
        f" --out docs/benchmarks.md` (`make bench-triton`). Machine: {os.cpu_count()} cores,"
        f" no GPU, Python {platform.python_version()}, torch {v['torch']}, onnxruntime"
        f" {v['onnxruntime']} in the embedder; Triton {v['triton']} (CPU build bundled in"
        f" PyTriton) running the same ONNX graph on onnxruntime {v['triton onnxruntime']} in"
        f" its Python backend ({v['triton model']}). all-MiniLM-L6-v2, one"
        " intra-op thread everywhere. Each backend behind its own `aimesh serve embedder`"
        " (default engine settings: micro-batches of up to 64 texts within 2 ms, passes of"
        " at most 256 padded tokens; max_concurrency 64); tokenizing and batching happen in"
        " the embedder for all three. The client is this process on loopback gRPC; all"
        " processes share the cores. Scenarios: one short sentence per request, and 32"
        " stdlib docstring paragraphs per request (cut at 256 tokens); backends alternate"
        f" cell by cell, their order rotating each round; {seconds:g} s per cell and round"
        f" ({seconds * SCENARIOS[-1].share:g} s for 32 paragraphs), after 5 warm-up calls."
        f" Vectors agree: lowest cosine against onnx over every text sent: {cosines}.",
        "",
        "| scenario | backend | calls | requests/s | texts/s | p50 ms | p99 ms |"
        " requests/s vs onnx | p50 vs onnx |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows(results),
        "",
        "Inside Triton, from its statistics (means over each scenario's requests, warm-up"
        " calls included): ModelInfer passes per request (the embedder sends one per padded"
        " pass of a micro-batch, which may hold several requests), time a pass waited in"
        " Triton's queue and computed (input, execute, output: the part a GPU would run),"
        " and compute per request, against the end-to-end p50.",
        "",
        "| scenario | passes / request | queue ms / pass | compute ms / pass |"
        " compute ms / request | end-to-end p50 ms |",
        "|---|---|---|---|---|---|",
        *triton_rows(results),
    ]
    return "\n".join([*lines, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="per cell and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = asyncio.run(run(args.seconds, args.rounds))
    markdown = report(results, args.seconds, args.rounds)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
