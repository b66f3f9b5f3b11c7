"""`aimesh ingest` and `aimesh search`: fill a collection and query it from the terminal."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.client import create_channel
from mesh.commands import run_command
from mesh.config import MeshSettings
from mesh.registry import discover
from services.retrieval.corpus import dedupe, file_passages, stdlib_passages

DEFAULT_COLLECTION = "knowledge"
UPLOAD_BATCH = 64
MODES = {
    "hybrid": retrieval_pb2.SEARCH_MODE_HYBRID,
    "dense": retrieval_pb2.SEARCH_MODE_DENSE,
    "sparse": retrieval_pb2.SEARCH_MODE_SPARSE,
}


def _target(settings: MeshSettings, name: str) -> str:
    return settings.target_of(name, discover()[name].default_port)


def ingest(
    sources: Annotated[
        list[Path] | None, typer.Argument(help="files or folders of .txt/.md; none: the stdlib")
    ] = None,
    collection: Annotated[str, typer.Option(help="collection to fill")] = DEFAULT_COLLECTION,
) -> None:
    """Chunk, deduplicate, embed and upsert documents; re-ingesting writes nothing new."""
    try:
        passages = list(dedupe(file_passages(sources) if sources else stdlib_passages()))
    except (ValueError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    documents = [retrieval_pb2.Document(id=p.id, text=p.text, payload=p.payload) for p in passages]
    settings = MeshSettings()

    async def run() -> retrieval_pb2.UpsertResponse:
        async with create_channel(_target(settings, "retrieval"), settings) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            await stub.CreateCollection(
                retrieval_pb2.CreateCollectionRequest(collection=collection, sparse_enabled=True)
            )
            with Progress(
                TextColumn("[bold]ingest[/bold] {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            ) as progress:
                task = progress.add_task(collection, total=len(documents))

                async def messages() -> AsyncIterator[retrieval_pb2.UpsertRequest]:
                    for start in range(0, len(documents), UPLOAD_BATCH):
                        batch = documents[start : start + UPLOAD_BATCH]
                        yield retrieval_pb2.UpsertRequest(collection=collection, documents=batch)
                        progress.advance(task, len(batch))

                return await stub.Upsert(messages(), timeout=3600)

    summary, _ = run_command("ingest", run, timeout_s=3600)
    typer.echo(
        f"{summary.received} passages: {summary.upserted} written, {summary.unchanged} unchanged "
        f"({summary.timing.total_ns / 1e9:.1f} s)"
    )


def search(
    query: Annotated[str, typer.Argument(help="what to look for")],
    top_k: Annotated[int, typer.Option(help="hits to show")] = 5,
    rerank: Annotated[bool, typer.Option(help="rerank the top candidates")] = False,
    mode: Annotated[str, typer.Option(help="hybrid, dense or sparse")] = "hybrid",
    collection: Annotated[str, typer.Option()] = DEFAULT_COLLECTION,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Search a collection; --rerank has retrieval reorder a deeper candidate list with the
    rerank service (in retrieval order, with a note, when rerank is unavailable)."""
    if mode not in MODES:
        raise typer.BadParameter(f"mode must be one of {', '.join(MODES)}")
    settings = MeshSettings()

    async def run() -> dict:
        async with create_channel(_target(settings, "retrieval"), settings) as channel:
            found = await retrieval_pb2_grpc.RetrievalServiceStub(channel).Search(
                retrieval_pb2.SearchRequest(
                    collection=collection, query=query, top_k=top_k, mode=MODES[mode], rerank=rerank
                )
            )
        result = {
            "hits": [{"id": h.id, "score": h.score, "text": h.text} for h in found.hits],
            "timing": {s.name: s.duration_ns / 1e6 for s in found.timing.stages},
        }
        if found.note:
            result["note"] = found.note
        return result

    result, trace_id = run_command("search", run, timeout_s=60)
    result["trace_id"] = trace_id
    if as_json:
        typer.echo(json.dumps(result))
        return
    if "note" in result:
        typer.echo(result["note"], err=True)
    for rank, hit in enumerate(result["hits"], start=1):
        first_line = hit["text"].splitlines()[0] if hit["text"] else ""
        typer.echo(f"{rank:2}. {hit['id']}  ({hit['score']:.4f})\n    {first_line[:100]}")
    typer.echo(f"[trace {result['trace_id']}]", err=True)
