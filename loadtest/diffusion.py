"""Diffusion: the mesh's cost per denoising step, images/s, and cancel-to-free time, one run.

(a) Per-step cost: the same digits job (DDIM, 50 steps, guidance 2) run by the service's
own sampling loop (`run_job`, PNG encoding included) in this process, and through the
mesh: `aimesh serve diffusion` as a child process on a free port, the client timing a
Generate call from send to Summary. Batches of 1, 10 and 100 images; median of 9 runs,
the two sides alternating; one intra-op thread on both.
(b) Images/s with 1 and 4 concurrent clients, each sending one-image jobs (digits at 50
steps, terrain at 128x128), on the default single compute slot.
(c) Cancel to slot freed: a long job runs, a second one waits behind it; the time from
sending Cancel for the first to the second's Queued(position 0), 20 times; the same with
a 2048x2048 terrain image (stopped between its tiles), 5 times.

    python -m loadtest.diffusion --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aimesh.diffusion.v1 import diffusion_pb2, diffusion_pb2_grpc
from loadtest.embed import free_port, percentile
from loadtest.mesh_overhead import write
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.health import wait_until_serving
from services.diffusion.digits import DigitsModel
from services.diffusion.jobs import Job
from services.diffusion.requests import plan_job
from services.diffusion.runner import Throttle, run_job
from services.diffusion.servicer import SERVICE
from services.diffusion.settings import DiffusionSettings

BEGIN, END = "<!-- diffusion:begin -->", "<!-- diffusion:end -->"
COMMAND = "python -m loadtest.diffusion --out docs/benchmarks.md"
STEPS = 50
BATCHES = (1, 10, 100)
RUNS = 9
# Both sides compute on one intra-op thread, so neither's compute competes with the other
# side's threads for the 2 cores.
THREADS = 1
# The service's defaults, so both sides send (or collect) the same messages.
THROTTLE = Throttle(
    DiffusionSettings().progress_min_interval_s, DiffusionSettings().preview_min_interval_s
)
Request = diffusion_pb2.GenerateRequest


def digits_request(images: int, seed: int = 0) -> diffusion_pb2.GenerateRequest:
    return Request(model="digits", prompt="3", num_images=images, steps=STEPS, seed=seed)


def in_process_seconds(model: DigitsModel, images: int, seed: int) -> float:
    started = time.perf_counter()
    _, plan = plan_job(digits_request(images, seed), {"digits": model})
    run_job(Job(model, plan, 0), [].append, preview_every=0, throttle=THROTTLE)
    return time.perf_counter() - started


async def through_mesh(stub, request: diffusion_pb2.GenerateRequest) -> float:
    started = time.perf_counter()
    async for _ in stub.Generate(request, timeout=600):
        pass
    return time.perf_counter() - started


async def per_step(stub, model: DigitsModel) -> dict[int, tuple[float, float]]:
    """Median seconds per job, in process and through the mesh, runs alternating so that
    the machine's noise falls on both alike; the first run of each warms up."""
    medians = {}
    for images in BATCHES:
        local, remote = [], []
        for run in range(RUNS + 1):
            local.append(in_process_seconds(model, images, run))
            remote.append(await through_mesh(stub, digits_request(images, run)))
        medians[images] = (statistics.median(local[1:]), statistics.median(remote[1:]))
    return medians


async def images_per_s(stub, request: diffusion_pb2.GenerateRequest, clients: int, jobs: int):
    remaining = iter(range(jobs))

    async def client() -> None:
        for seed in remaining:
            request.seed = seed
            await through_mesh(stub, request)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return jobs / (time.perf_counter() - started)


async def cancel_to_free(stub, long: diffusion_pb2.GenerateRequest, trials: int) -> list[float]:
    """Seconds from sending Cancel for a running job to the next job starting."""
    waits = []
    short = digits_request(1)
    for _ in range(trials):
        running = stub.Generate(long, timeout=600)
        job_id = (await anext(aiter(running))).queued.job_id
        waiting = stub.Generate(short, timeout=600)
        waiting_events = aiter(waiting)
        assert (await anext(waiting_events)).queued.position == 1
        await asyncio.sleep(0.3)
        sent = time.perf_counter()
        await stub.Cancel(diffusion_pb2.CancelRequest(job_id=job_id))
        assert (await anext(waiting_events)).queued.position == 0
        waits.append(time.perf_counter() - sent)
        async for _ in waiting_events:
            pass
        running.cancel()
    return waits


async def mesh_runs(target: str, model: DigitsModel) -> dict:
    async with create_channel(target, MeshSettings(), services=[SERVICE]) as channel:
        stub = diffusion_pb2_grpc.DiffusionServiceStub(channel)
        steps = await per_step(stub, model)
        throughput = {}
        for name, request, jobs in (
            ("digits, 50 steps", digits_request(1), 40),
            ("terrain, 128x128", Request(model="terrain"), 16),
        ):
            for clients in (1, 4):
                throughput[name, clients] = await images_per_s(stub, request, clients, jobs)
        long_digits = Request(
            model="digits", prompt="2", num_images=100, steps=200,
            sampler=diffusion_pb2.SAMPLER_DDPM,
        )  # fmt: skip
        long_terrain = Request(model="terrain", width=2048, height=2048)
        cancels = {
            "digits, 100 images x 200 DDPM steps": await cancel_to_free(stub, long_digits, 20),
            "terrain, one 2048x2048 image": await cancel_to_free(stub, long_terrain, 5),
        }
    return {"per_step": steps, "throughput": throughput, "cancels": cancels}


def start_worker(port: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "AIMESH_SERVICES__DIFFUSION__PORT": str(port),
        "AIMESH_SERVICES__DIFFUSION__METRICS_PORT": "0",
        "AIMESH_SERVICES__DIFFUSION__THREADS": str(THREADS),
        "AIMESH_LOG_LEVEL": "WARNING",
        "GRPC_VERBOSITY": "ERROR",
    }
    aimesh = Path(sys.executable).parent / "aimesh"
    with log.open("w") as handle:
        return subprocess.Popen([str(aimesh), "serve", "diffusion"], env=env, stderr=handle)


def report(mesh: dict) -> str:
    lines = [
        BEGIN,
        "## Diffusion: per-step cost through the mesh, images/s, cancel to slot freed",
        "",
        f"`{COMMAND}` on {os.cpu_count()} cores ({platform.processor() or platform.machine()}),"
        f" torch {torch.__version__}, CPU. The in-process column runs the service's own"
        " sampling loop (PNG encoding included) in the benchmark process; the mesh column is"
        " a Generate call to `aimesh serve diffusion` in another process, from send to"
        " Summary, Progress messages throttled as the service's defaults do. Median of 9"
        f" runs, the two alternating, {THREADS} intra-op thread on both.",
        "",
        f"| digits job, DDIM {STEPS} steps | in process | through the mesh | per step, mesh "
        "| overhead |",
        "|---|---:|---:|---:|---:|",
    ]
    for images, (local, remote) in mesh["per_step"].items():
        lines.append(
            f"| {images} image(s) | {local * 1000:.1f} ms | {remote * 1000:.1f} ms "
            f"| {remote / STEPS * 1000:.2f} ms | {(remote / local - 1) * 100:+.1f}% |"
        )
    lines += ["", "| images/s, one-image jobs | 1 client | 4 clients |", "|---|---:|---:|"]
    for name in dict.fromkeys(name for name, _ in mesh["throughput"]):
        one, four = mesh["throughput"][name, 1], mesh["throughput"][name, 4]
        lines.append(f"| {name} | {one:.1f} | {four:.1f} |")
    lines += ["", "| Cancel -> next job starts | p50 | p95 | max |", "|---|---:|---:|---:|"]
    for name, waits in mesh["cancels"].items():
        lines.append(
            f"| {name} ({len(waits)}x) | {percentile(waits, 0.5) * 1000:.1f} ms "
            f"| {percentile(waits, 0.95) * 1000:.1f} ms | {max(waits) * 1000:.1f} ms |"
        )
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    model = DigitsModel()
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="aimesh-bench-")) / "diffusion.log"
    worker = start_worker(port, log)
    target = f"127.0.0.1:{port}"
    try:
        if not asyncio.run(wait_until_serving(target, "diffusion", timeout_s=120)):
            raise SystemExit(f"the diffusion worker did not start; see {log}")
        mesh = asyncio.run(mesh_runs(target, model))
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    markdown = report(mesh)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
