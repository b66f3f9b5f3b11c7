"""Retrieval quality on the hand-labelled stdlib questions, and retrieval speed.

Quality: recall@5, recall@10, nDCG@10 and MRR of dense, hybrid (dense + BM25, RRF) and
hybrid followed by rerank, through the real services. Speed, in the same run: search
p50/p99 through the mesh vs direct qdrant-client on the same collection, rerank latency
for 20 and 50 candidates, and how the embedded (brute-force) Qdrant slows with size.

    python -m loadtest.retrieval_eval --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.health import wait_until_serving

QUESTIONS = Path(__file__).parent / "data" / "stdlib_questions.jsonl"
BEGIN, END = "<!-- retrieval:begin -->", "<!-- retrieval:end -->"
CANDIDATES = 20
# Reranked hits per question: retrieval gives the reranker max(4 * 10, 20) = 40 candidates.
RERANKED = 10


@dataclass(frozen=True)
class Question:
    text: str
    relevant: frozenset[str]


def questions() -> list[Question]:
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return [Question(r["question"], frozenset(r["relevant"])) for r in rows]


def quality(labelled: list[Question], rankings: list[list[str]]) -> dict[str, float]:
    """Mean recall@5, recall@10, nDCG@10 (binary relevance) and MRR over the questions."""
    totals = {"recall@5": 0.0, "recall@10": 0.0, "ndcg@10": 0.0, "mrr": 0.0}
    for question, ranked in zip(labelled, rankings, strict=True):
        relevant = question.relevant
        totals["recall@5"] += len(relevant & set(ranked[:5])) / len(relevant)
        totals["recall@10"] += len(relevant & set(ranked[:10])) / len(relevant)
        dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(ranked[:10]) if d in relevant)
        ideal = sum(1 / math.log2(i + 2) for i in range(min(len(relevant), 10)))
        totals["ndcg@10"] += dcg / ideal
        totals["mrr"] += next((1 / (i + 1) for i, d in enumerate(ranked) if d in relevant), 0.0)
    return {name: value / len(labelled) for name, value in totals.items()}


async def rankings(
    retrieval: retrieval_pb2_grpc.RetrievalServiceStub,
    collection: str,
    labelled: list[Question],
) -> tuple[dict[str, list[list[str]]], dict[str, list[float]]]:
    """Each question's ranked ids per pipeline, and each pipeline's latencies. "hybrid +
    rerank" is one Search with rerank: retrieval has the rerank service reorder its
    max(4 * top_k, 20) best hybrid candidates and returns the top_k."""
    ranked: dict[str, list[list[str]]] = {"dense": [], "hybrid": [], "hybrid + rerank": []}
    latency: dict[str, list[float]] = {name: [] for name in ranked}
    for question in labelled:
        for name, mode, rerank in (
            ("dense", retrieval_pb2.SEARCH_MODE_DENSE, False),
            ("hybrid", retrieval_pb2.SEARCH_MODE_HYBRID, False),
            ("hybrid + rerank", retrieval_pb2.SEARCH_MODE_HYBRID, True),
        ):
            started = time.perf_counter()
            found = await retrieval.Search(
                retrieval_pb2.SearchRequest(
                    collection=collection,
                    query=question.text,
                    top_k=RERANKED if rerank else CANDIDATES,
                    mode=mode,
                    rerank=rerank,
                )
            )
            if found.note:
                raise RuntimeError(f"the search was not reranked: {found.note}")
            latency[name].append(time.perf_counter() - started)
            ranked[name].append([h.id for h in found.hits])
    return ranked, latency


# ---- the benchmark run (separate processes, as aimesh up runs them) ----

PORTS = {"embedder": 50870, "retrieval": 50871, "rerank": 50872}


def _start(root: Path) -> list[subprocess.Popen]:
    config = root / "aimesh.toml"
    config.write_text(
        "".join(f"[services.{n}]\nport = {p}\nmetrics_port = 0\n" for n, p in PORTS.items())
    )
    env = {
        **os.environ,
        "AIMESH_CONFIG": str(config),
        "AIMESH_SERVICES__RETRIEVAL__PATH": str(root / "qdrant"),
        "GRPC_VERBOSITY": "ERROR",
        "AIMESH_LOG_LEVEL": "WARNING",
    }
    aimesh = str(Path(sys.executable).parent / "aimesh")
    processes = [
        subprocess.Popen([aimesh, "serve", name], env=env, stderr=(root / f"{name}.log").open("w"))
        for name in PORTS
    ]
    try:
        for name, port in PORTS.items():
            if not asyncio.run(wait_until_serving(f"127.0.0.1:{port}", name, timeout_s=600)):
                raise SystemExit(f"{name} did not start; see {root / (name + '.log')}")
        ingest = subprocess.run(
            [aimesh, "ingest", "--collection", "stdlib"],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if ingest.returncode != 0:
            raise SystemExit(f"ingest failed: {ingest.stderr[-2000:]}")
    except BaseException:
        for process in processes:
            process.terminate()
        raise
    print(ingest.stdout.strip().splitlines()[-1], file=sys.stderr)
    return processes


def _percentiles(values: Iterable[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] * 1000, ordered[
        min(int(0.99 * len(ordered)), len(ordered) - 1)
    ] * 1000


async def _mesh_run(labelled: list[Question]) -> tuple[dict, dict, dict]:
    import grpc

    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{PORTS['retrieval']}") as r_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{PORTS['rerank']}") as k_channel,
    ):
        retrieval = retrieval_pb2_grpc.RetrievalServiceStub(r_channel)
        rerank = rerank_pb2_grpc.RerankServiceStub(k_channel)
        ranked, latency = await rankings(retrieval, "stdlib", labelled)
        rerank_latency = {}
        for size in (20, 50):
            found = await retrieval.Search(
                retrieval_pb2.SearchRequest(collection="stdlib", query=labelled[0].text, top_k=size)
            )
            documents = [rerank_pb2.Document(id=h.id, text=h.text) for h in found.hits]
            times = []
            for question in labelled[:20]:
                started = time.perf_counter()
                await rerank.Rerank(
                    rerank_pb2.RerankRequest(
                        query=question.text, documents=documents, truncate=True
                    )
                )
                times.append(time.perf_counter() - started)
            rerank_latency[size] = _percentiles(times)
    return ranked, latency, rerank_latency


def _direct(root: Path, labelled: list[Question]) -> tuple[float, float]:
    """The same dense queries straight to qdrant-client on the same folder, with the query
    embedded in process by the same ONNX encoder (so only the mesh's hops differ)."""
    from qdrant_client import QdrantClient

    from mesh.config import MeshSettings
    from services.embedder.encoder import Encoder
    from services.embedder.settings import EmbedderSettings

    encoder = Encoder.load(EmbedderSettings(), MeshSettings().cache_dir)
    client = QdrantClient(path=str(root / "qdrant"))
    times = []
    for question in labelled:
        started = time.perf_counter()
        vectors, _ = encoder.encode([question.text])
        vector = vectors[0]
        client.query_points(
            "stdlib", query=vector.tolist(), using="dense", limit=CANDIDATES, with_payload=True
        )
        times.append(time.perf_counter() - started)
    client.close()
    return _percentiles(times)


def local_mode_scaling(sizes=(1_000, 5_000, 10_000, 20_000, 50_000)) -> list[tuple[int, float]]:
    """Median dense query time of embedded Qdrant (brute force) by collection size."""
    from qdrant_client import QdrantClient, models

    rng = np.random.default_rng(0)
    results = []
    for size in sizes:
        client = QdrantClient(":memory:")
        client.create_collection(
            "scale", vectors_config=models.VectorParams(size=384, distance=models.Distance.COSINE)
        )
        vectors = rng.standard_normal((size, 384), dtype=np.float32)
        for start in range(0, size, 1000):
            client.upsert(
                "scale",
                points=models.Batch(
                    ids=list(range(start, min(start + 1000, size))),
                    vectors=vectors[start : start + 1000].tolist(),
                ),
            )
        times = []
        for _ in range(30):
            query = rng.standard_normal(384).tolist()
            started = time.perf_counter()
            client.query_points("scale", query=query, limit=10)
            times.append(time.perf_counter() - started)
        results.append((size, statistics.median(times) * 1000))
        client.close()
    return results


def report(
    scores: dict,
    latency: dict,
    rerank_latency: dict,
    direct: tuple[float, float],
    scaling: list[tuple[int, float]],
    count: int,
) -> str:
    lines = [
        BEGIN,
        "## Retrieval quality and speed on the stdlib knowledge base",
        "",
        "Command: `python -m loadtest.retrieval_eval` (`make bench-retrieval`). Corpus: "
        "4,080 passages from 124 stdlib modules and pydoc topics (`aimesh ingest`), "
        f"{count} hand-written questions with labelled answers "
        "(loadtest/data/stdlib_questions.jsonl). Embedder, retrieval and rerank are separate "
        "processes; hybrid + rerank is one Search with rerank (top_k 10): retrieval has "
        "rerank reorder its 40 best hybrid candidates.",
        "",
        "| pipeline | recall@5 | recall@10 | nDCG@10 | MRR | latency p50 / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, values in scores.items():
        p50, p99 = _percentiles(latency[name])
        lines.append(
            f"| {name} | {values['recall@5']:.3f} | {values['recall@10']:.3f} | "
            f"{values['ndcg@10']:.3f} | {values['mrr']:.3f} | {p50:.0f} / {p99:.0f} |"
        )
    dense_p50, dense_p99 = _percentiles(latency["dense"])
    lines += [
        "",
        f"- Dense search through the mesh (embed hop + search hop): p50 {dense_p50:.1f} ms, "
        f"p99 {dense_p99:.1f} ms; the same queries straight to qdrant-client on the same "
        f"folder with the query embedded in process: p50 {direct[0]:.1f} ms, p99 "
        f"{direct[1]:.1f} ms.",
        "- Rerank latency: "
        + ", ".join(
            f"{n} candidates p50 {p50:.0f} ms / p99 {p99:.0f} ms"
            for n, (p50, p99) in rerank_latency.items()
        ),
        "- Embedded Qdrant (brute force), median dense query by collection size: "
        + ", ".join(f"{size:,}: {ms:.1f} ms" for size, ms in scaling),
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    labelled = questions()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        processes = _start(root)
        try:
            ranked, latency, rerank_latency = asyncio.run(_mesh_run(labelled))
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)
        direct = _direct(root, labelled)
    scores = {name: quality(labelled, runs) for name, runs in ranked.items()}
    markdown = report(scores, latency, rerank_latency, direct, local_mode_scaling(), len(labelled))
    print(markdown)
    if args.out:
        from loadtest.mesh_overhead import write

        write(markdown, args.out)


if __name__ == "__main__":
    main()
