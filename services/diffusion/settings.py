"""The diffusion service's settings ([services.diffusion] in the mesh config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from mesh.config import ServiceOptions
from mesh.triton import TritonSettings


class DiffusionSettings(ServiceOptions):
    models: list[Literal["digits", "terrain"]] = Field(default=["digits", "terrain"], min_length=1)

    @field_validator("models", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        """From the environment, engine settings arrive as text: "digits,terrain"."""
        return [part.strip() for part in value.split(",")] if isinstance(value, str) else value

    # auto: CUDA when torch / ONNX Runtime can use it, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(
        default=None, ge=1, description="intra-op threads; None: the runtimes' defaults"
    )
    # The compute semaphore: jobs that run at once on this worker's device.
    slots: int = Field(default=1, ge=1)
    max_queued_jobs: int = Field(default=32, ge=0, description="jobs waiting beyond the slots")
    memory_budget_mb: int | None = Field(
        default=None,
        ge=1,
        description="estimated memory running jobs may hold; None: half the free RAM, "
        "or 80% of the free GPU memory on CUDA",
    )
    # A progress bar needs no more than ~20 updates a second; previews cost a PNG each.
    progress_min_interval_s: float = Field(default=0.05, ge=0)
    preview_min_interval_s: float = Field(default=0.25, ge=0)
    # terrain_backend = "triton": the terrain UNet's forward passes run on Triton Inference
    # Server (k8s/triton-model-repository/terrain_denoiser serves the same ONNX file), as
    # the [services.diffusion.triton] section says; noise, tiles, blending and cancellation
    # stay here. `device` and `threads` then concern the digits model alone.
    terrain_backend: Literal["onnx", "triton"] = "onnx"
    triton: TritonSettings | None = None

    @model_validator(mode="after")
    def _triton_named(self) -> DiffusionSettings:
        if self.terrain_backend == "triton" and self.triton is None:
            raise ValueError("terrain_backend 'triton' needs a [services.diffusion.triton] section")
        return self
