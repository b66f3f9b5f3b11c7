"""`aimesh imagine`: run one diffusion job through the mesh and save its images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from mesh.client import create_channel
from mesh.commands import run_command
from mesh.config import MeshSettings
from mesh.timing import timing_ms
from services.diffusion import SPEC

# From the generated code, not the servicer: a command must not import the engine.
SERVICE = diffusion_pb2.DESCRIPTOR.services_by_name["DiffusionService"]

# The API's samplers by their lower-case names: ddpm, ddim, consistency.
SAMPLERS = {n.removeprefix("SAMPLER_").lower(): v for n, v in diffusion_pb2.Sampler.items() if v}


def image_path(out: Path, model: str, image: diffusion_pb2.Image, count: int) -> Path:
    """`out` itself for one image named *.png, `stem-k.png` beside it for more, else
    `out/<model>-<seed>.png`."""
    if out.suffix == ".png":
        return out if count == 1 else out.with_name(f"{out.stem}-{image.index}.png")
    return out / f"{model}-{image.seed}.png"


async def _imagine(request: diffusion_pb2.GenerateRequest, out: Path, progress: Progress) -> dict:
    settings = MeshSettings()
    target = settings.target_of(SPEC.name, SPEC.default_port)
    count = request.num_images if request.HasField("num_images") else 1
    task = progress.add_task("connecting", total=None)
    paths: list[str] = []
    async with create_channel(target, settings, services=[SERVICE]) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        async for event in stub.Generate(request):
            kind = event.WhichOneof("event")
            if kind == "queued":
                position = event.queued.position
                where = f"queued, position {position}" if position else "running"
                progress.update(task, description=f"job {event.queued.job_id[:8]} {where}")
            elif kind == "progress":
                progress.update(
                    task, total=event.progress.total_steps, completed=event.progress.step
                )
            elif kind == "image":
                path = image_path(out, request.model, event.image, count)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(event.image.png)
                paths.append(str(path))
            elif kind == "summary":
                summary = event.summary
    return {
        "images": paths,
        "seeds": list(summary.seeds),
        "timing": timing_ms(summary.timing),
        "job_id": summary.job_id,
    }


def parse_conditioning(pairs: list[str]) -> dict[str, float]:
    conditioning = {}
    for pair in pairs:
        key, _, value = pair.partition("=")  # no "=": value is "", which is no number
        try:
            conditioning[key] = float(value)
        except ValueError:
            raise typer.BadParameter(
                f"{pair!r} is not KEY=NUMBER", param_hint="--condition"
            ) from None
    return conditioning


def imagine(
    model: Annotated[str, typer.Option(help="a model from ListModels: digits, terrain")],
    prompt: Annotated[str, typer.Option(help="digits: 0-9 or a digit's English word")] = "",
    steps: Annotated[int | None, typer.Option(help="default: the model's")] = None,
    seed: Annotated[int | None, typer.Option(help="image k uses seed + k")] = None,
    n: Annotated[int, typer.Option("--n", help="images in the batch")] = 1,
    sampler: Annotated[str | None, typer.Option(help="ddim, ddpm or consistency")] = None,
    guidance: Annotated[float | None, typer.Option(help="classifier-free guidance")] = None,
    size: Annotated[int, typer.Option(help="square side in pixels; 0: the model's")] = 0,
    condition: Annotated[
        list[str] | None, typer.Option(help="KEY=NUMBER, e.g. difficulty=60; repeatable")
    ] = None,
    out: Annotated[Path, typer.Option(help="a directory, or a .png path")] = Path("."),
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object at the end")] = False,
    timeout: Annotated[float, typer.Option(help="seconds for the whole job")] = 300.0,
) -> None:
    """Generate images through the diffusion service, with a progress bar."""
    if sampler is not None and sampler not in SAMPLERS:
        raise typer.BadParameter(f"one of {', '.join(SAMPLERS)}", param_hint="--sampler")
    request = diffusion_pb2.GenerateRequest(
        model=model,
        prompt=prompt,
        num_images=n,
        steps=steps,  # None leaves a field unset: the model's default
        seed=seed,
        guidance_scale=guidance,
        sampler=SAMPLERS.get(sampler or "", diffusion_pb2.SAMPLER_UNSPECIFIED),
        width=size,
        height=size,
        conditioning=parse_conditioning(condition or []),
    )
    # Disabled for --json: the bar never draws, and stdout holds the JSON alone.
    columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=as_json) as progress:
        result, trace_id = run_command(
            "imagine", lambda: _imagine(request, out, progress), timeout_s=timeout
        )
    result["trace_id"] = trace_id
    if as_json:
        typer.echo(json.dumps(result))
        return
    for path in result["images"]:
        typer.echo(path)
    table = Table("stage", "ms", title=f"trace {trace_id}")
    for name, ms in result["timing"].items():
        table.add_row(name, f"{ms:.1f}")
    Console(stderr=True).print(table)
    typer.echo(
        f"[{len(result['images'])} image(s), seeds {result['seeds']}, "
        f"{result['timing']['total']:.0f} ms, trace {trace_id}]",
        err=True,
    )
