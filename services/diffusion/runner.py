"""Runs one admitted job on a worker thread and turns its progress into stream events."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.failures import OutOfMemory
from services.diffusion.jobs import Job
from services.diffusion.metrics import IMAGES, STEP_SECONDS
from services.diffusion.png import encode_png
from services.shared.memory import is_out_of_memory

Emit = Callable[[diffusion_pb2.GenerateResponse], None]


@dataclass(frozen=True)
class RunTimes:
    denoise_s: float
    encode_s: float


@dataclass(frozen=True)
class Throttle:
    """Least seconds between two Progress messages (the last step is always sent) and
    between two rounds of Previews. A Progress per step of a job that steps every 0.3 ms
    would cost the event loop more GIL time than the sampling itself gets."""

    progress_s: float
    preview_s: float


def run_job(job: Job, emit: Emit, *, preview_every: int, throttle: Throttle) -> RunTimes:
    """Steps every image of `job`, emitting throttled Progress and Previews, then the Images.

    A real out-of-memory error frees what the job allocated and fails this job alone.
    """
    try:
        return _run(job, emit, preview_every, throttle)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        message = f"job {job.id} ran out of memory and was stopped: {error}"
    # Outside the except block, the error's traceback (which holds the job's arrays) is gone.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    raise OutOfMemory(message)


def _run(job: Job, emit: Emit, preview_every: int, throttle: Throttle) -> RunTimes:
    plan = job.plan
    sampling = job.model.start(plan)
    started = time.perf_counter()
    last_progress = last_preview = float("-inf")
    step_seconds = STEP_SECONDS.labels(job.model.card.name)
    step_started = started
    for step in range(1, plan.steps + 1):
        for index in range(len(plan.seeds)):
            job.check_cancelled()
            sampling.advance(index, job.check_cancelled)
        now = time.perf_counter()
        step_seconds.observe(now - step_started)
        step_started = now
        if step == plan.steps or now - last_progress >= throttle.progress_s:
            last_progress = now
            eta_ms = round((now - started) / step * (plan.steps - step) * 1000)
            progress = diffusion_pb2.Progress(step=step, total_steps=plan.steps, eta_ms=eta_ms)
            emit(diffusion_pb2.GenerateResponse(progress=progress))
        due = preview_every and step % preview_every == 0 and step < plan.steps
        if due and now - last_preview >= throttle.preview_s:
            last_preview = time.perf_counter()
            for index in range(len(plan.seeds)):
                preview = diffusion_pb2.Preview(
                    index=index, step=step, png=encode_png(sampling.preview(index))
                )
                emit(diffusion_pb2.GenerateResponse(preview=preview))
    denoised = time.perf_counter()
    for index, seed in enumerate(plan.seeds):
        job.check_cancelled()
        pixels = sampling.result(index)
        height, width = pixels.shape
        image = diffusion_pb2.Image(
            index=index, seed=seed, png=encode_png(pixels), width=width, height=height
        )
        emit(diffusion_pb2.GenerateResponse(image=image))
        IMAGES.labels(job.model.card.name).inc()
    job.complete()
    return RunTimes(denoise_s=denoised - started, encode_s=time.perf_counter() - denoised)
