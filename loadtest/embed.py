"""Embedding throughput: sentence-transformers vs the embedder's backends vs the mesh, one run.

The same 512 texts go through (a) sentence-transformers' own `encode`, (b) the embedder's
torch backend and (c) its ONNX Runtime backend, each in this process in calls of 32 texts,
and then (d) through the mesh: `aimesh serve embedder` as a child process on a free port,
once per backend, with 8 concurrent clients sending 8 texts per request, which the
server's micro-batcher merges. sentence-transformers pads each call of 32 into one
forward pass; the embedder sorts a call's (or a micro-batch's) texts by length into passes
of at most max_batch_tokens padded tokens, so both backends also run with one pass per
call, to tell the runtime's share from the pass shaping's. Every engine uses one
intra-op thread, the embedder's default. The texts are paragraphs of stdlib docstrings,
a few words to a few hundred tokens long; longer ones are cut at the model's 256 tokens.

    python -m loadtest.embed --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from sentence_transformers import SentenceTransformer

from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from loadtest.mesh_overhead import write
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from services.embedder.backends import OnnxBackend
from services.embedder.encoder import Encoder
from services.embedder.servicer import SERVICE
from services.embedder.settings import EmbedderSettings

BEGIN, END = "<!-- embed:begin -->", "<!-- embed:end -->"
TEXTS = 512
BATCH = 32
CLIENTS = 8
PER_REQUEST = 8
MODULES = (
    "json", "os", "re", "asyncio", "subprocess", "collections", "itertools", "functools",
    "pathlib", "typing", "logging", "argparse", "inspect", "socket", "threading", "datetime",
)  # fmt: skip
COMMAND = "python -m loadtest.embed --out docs/benchmarks.md"


def corpus() -> list[str]:
    """The first 512 distinct paragraphs of the modules' and their members' docstrings, in
    a fixed order: one-line summaries, argument lists and long explanations mixed."""
    return list(dict.fromkeys(_paragraphs()))[:TEXTS]


def _paragraphs() -> Iterator[str]:
    for name in MODULES:
        module = importlib.import_module(name)
        for _, member in sorted(inspect.getmembers(module), key=lambda item: item[0]):
            for paragraph in (inspect.getdoc(member) or "").split("\n\n"):
                if paragraph.strip():
                    yield paragraph.strip()


@dataclass
class Row:
    engine: str
    where: str
    texts_per_s: float
    call_p50_ms: float
    call_p99_ms: float
    min_cosine: float  # against sentence-transformers, over every text


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def timed_batches(
    encode: Callable[[list[str]], np.ndarray], texts: list[str]
) -> tuple[np.ndarray, float, list[float]]:
    """Vectors of `texts` encoded 32 at a time, after one warm-up call; seconds; per call."""
    encode(texts[:BATCH])
    calls, parts = [], []
    started = time.perf_counter()
    for start in range(0, len(texts), BATCH):
        call_started = time.perf_counter()
        parts.append(encode(texts[start : start + BATCH]))
        calls.append(time.perf_counter() - call_started)
    return np.concatenate(parts), time.perf_counter() - started, calls


def row(
    engine: str,
    where: str,
    vectors: np.ndarray,
    seconds: float,
    calls: list[float],
    reference: np.ndarray,
) -> Row:
    cosine = float((vectors * reference).sum(axis=1).min())
    p50, p99 = percentile(calls, 0.5) * 1e3, percentile(calls, 0.99) * 1e3
    return Row(engine, where, len(vectors) / seconds, p50, p99, cosine)


def in_process(
    texts: list[str], cache_dir: Path
) -> tuple[np.ndarray, list[Row], list[int], list[str]]:
    torch.set_num_threads(1)
    onnx = Encoder.load(EmbedderSettings(backend="onnx"), cache_dir)
    model = SentenceTransformer(str(onnx.model.path), device="cpu")
    reference, seconds, calls = timed_batches(
        lambda batch: model.encode(batch, batch_size=BATCH), texts
    )
    rows = [
        row("sentence-transformers `encode`", "in process", reference, seconds, calls, reference)
    ]
    encoders = {"torch": Encoder.load(EmbedderSettings(backend="torch"), cache_dir), "onnx": onnx}
    for name, encoder in encoders.items():
        default, one_pass = encoder.max_batch_tokens, BATCH * encoder.model.max_tokens
        for budget in (default, one_pass):
            shaped = replace(encoder, max_batch_tokens=budget)
            vectors, seconds, calls = timed_batches(
                lambda batch, e=shaped: e.encode(batch)[0], texts
            )
            label = f"passes of <= {budget} tokens" if budget == default else "one pass per call"
            engine = f"embedder `{name}` backend, {label}"
            rows.append(row(engine, "in process", vectors, seconds, calls, reference))
    assert isinstance(onnx.backend, OnnxBackend)
    return reference, rows, onnx.encode(texts)[1], onnx.backend.providers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def through_mesh(
    target: str, texts: list[str], dimensions: int
) -> tuple[np.ndarray, float, list[float]]:
    """8 clients take the next 8 texts until none are left; vectors in text order."""
    chunks = [
        (start, texts[start : start + PER_REQUEST]) for start in range(0, len(texts), PER_REQUEST)
    ]
    vectors = np.empty((len(texts), dimensions), dtype=np.float32)
    calls: list[float] = []
    async with create_channel(target, MeshSettings(), services=[SERVICE]) as channel:
        stub = embedder_pb2_grpc.EmbedderServiceStub(channel)

        async def embed(batch: list[str]) -> np.ndarray:
            request = embedder_pb2.EmbedRequest(inputs=batch, truncate=True)
            response = await stub.Embed(request, timeout=60)
            return np.array([e.values for e in response.embeddings], dtype=np.float32)

        await asyncio.gather(*(embed(texts[:PER_REQUEST]) for _ in range(CLIENTS)))  # warm-up
        pending = iter(chunks)

        async def client() -> None:
            for start, batch in pending:
                call_started = time.perf_counter()
                vectors[start : start + len(batch)] = await embed(batch)
                calls.append(time.perf_counter() - call_started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        return vectors, time.perf_counter() - started, calls


def embedder_env(backend: str, port: int) -> dict[str, str]:
    """`aimesh serve embedder` on `backend` with default engine settings, quiet, on `port`.
    Admission's default of 4 calls at once would hold half of 8 clients out of a batch."""
    return {
        **os.environ,
        "AIMESH_SERVICES__EMBEDDER__PORT": str(port),
        "AIMESH_SERVICES__EMBEDDER__METRICS_PORT": "0",
        "AIMESH_SERVICES__EMBEDDER__MAX_CONCURRENCY": "64",
        "AIMESH_SERVICES__EMBEDDER__BACKEND": backend,
        "AIMESH_LOG_LEVEL": "WARNING",
        "GRPC_VERBOSITY": "ERROR",
        "HF_HUB_OFFLINE": "1",
    }


def mesh_row(backend: str, texts: list[str], reference: np.ndarray, log_dir: Path) -> Row:
    port = free_port()
    env = embedder_env(backend, port)
    aimesh = Path(sys.executable).parent / "aimesh"
    with (log_dir / f"embedder-{backend}.log").open("w") as log:
        server = subprocess.Popen([str(aimesh), "serve", "embedder"], env=env, stderr=log)
    target = f"127.0.0.1:{port}"
    try:
        if not asyncio.run(wait_until_serving(target, "embedder", timeout_s=300)):
            raise SystemExit(f"the embedder ({backend}) did not start; see {log_dir}")
        vectors, seconds, calls = asyncio.run(through_mesh(target, texts, reference.shape[1]))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return row(f"embedder service, `{backend}`", "mesh", vectors, seconds, calls, reference)


def report(rows: list[Row], tokens: list[int], providers: list[str]) -> str:
    lines = [
        BEGIN,
        "## Embeddings: sentence-transformers vs the embedder, in process and through the mesh",
        "",
        f"Command: `{COMMAND}`. all-MiniLM-L6-v2, {len(tokens)} paragraphs of stdlib docstrings"
        f" ({min(tokens)}-{max(tokens)} tokens after cutting at 256, mean {np.mean(tokens):.0f}),"
        f" normalized. Machine: {os.cpu_count()} cores, Python {platform.python_version()},"
        f" torch {torch.__version__}, onnxruntime {onnxruntime.__version__} on"
        f" {', '.join(providers)}; one intra-op thread everywhere. In process: calls of 32"
        " texts in corpus order; sentence-transformers pads each into one forward pass, the"
        " embedder sorts it into passes of at most max_batch_tokens (default 256) padded"
        " tokens, or one pass per call when max_batch_tokens is 32 x 256. Mesh:"
        " `aimesh serve embedder` as a child process (max_concurrency 64, default engine"
        " settings), 8 concurrent clients sending 8 texts per request over loopback gRPC;"
        " the client shares the cores. A call is one batch of 32 in process and one request"
        " of 8 through the mesh. Cosine: the lowest over all texts against"
        " sentence-transformers' vector.",
        "",
        "| engine | where | texts/s | call p50 ms | call p99 ms | min cosine vs ST |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.engine} | {r.where} | {r.texts_per_s:,.1f} | {r.call_p50_ms:,.0f} |"
        f" {r.call_p99_ms:,.0f} | {r.min_cosine:.6f} |"
        for r in rows
    ]
    return "\n".join([*lines, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = corpus()
    reference, rows, tokens, providers = in_process(texts, MeshSettings().cache_dir)
    with tempfile.TemporaryDirectory() as log_dir:
        rows += [
            mesh_row(backend, texts, reference, Path(log_dir)) for backend in ("torch", "onnx")
        ]
    markdown = report(rows, tokens, providers)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
