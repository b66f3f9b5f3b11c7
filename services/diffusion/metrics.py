"""Diffusion metrics: the job queue's state, job outcomes and per-step time, by model."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RUNNING = Gauge("aimesh_diffusion_running_jobs", "Diffusion jobs holding a compute slot.")
WAITING = Gauge("aimesh_diffusion_queued_jobs", "Diffusion jobs waiting for a slot or memory.")
RESERVED = Gauge(
    "aimesh_diffusion_memory_reserved_bytes", "Estimated memory held by running diffusion jobs."
)
JOBS = Counter(
    "aimesh_diffusion_jobs_total",
    "Diffusion jobs by how they ended: completed, cancelled, out_of_memory, failed.",
    ["model", "outcome"],
)
IMAGES = Counter("aimesh_diffusion_images_total", "Images delivered.", ["model"])
STEP_SECONDS = Histogram(
    "aimesh_diffusion_step_seconds",
    "Time of one denoising step of a whole batch.",
    ["model"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
)
