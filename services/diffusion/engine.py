"""What the job runner needs from a model, whatever runs it (torch, ONNX Runtime).

A model is stepped one (step, image) unit at a time. That granularity is what lets a
cancel land within one unit, lets Progress mean "step i of the whole batch", and keeps
every image computed alone with the same tensor shapes whatever the batch size: image k
of a batch is then bit-identical to the same seed run alone (batched matmuls and
convolutions may sum in another order for another batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.validation import Violations


@dataclass(frozen=True)
class ModelCard:
    """What ListModels tells clients and what validation enforces."""

    name: str
    description: str
    conditioning: str
    # Square output sides in pixels; the first is the default.
    sizes: tuple[int, ...]
    max_steps: int
    default_steps: int
    max_images: int
    # The first is the default.
    samplers: tuple[diffusion_pb2.Sampler.ValueType, ...]
    # None: the model takes no classifier-free guidance.
    default_guidance: float | None
    max_guidance: float = 20.0


@dataclass(frozen=True)
class Provenance:
    """What GetInfo says of a loaded model: which bytes, on what, run by what."""

    sha256: str
    dtype: str
    device: str
    engine: str


@dataclass(frozen=True)
class Plan:
    """One validated job, in the model's own terms."""

    condition: object
    size: int
    steps: int
    sampler: diffusion_pb2.Sampler.ValueType
    guidance: float | None
    seeds: tuple[int, ...]


class Sampling(Protocol):
    """One job's images in flight."""

    def advance(self, index: int, interrupt: Callable[[], None]) -> None:
        """Run the next denoising step of image `index`. A step that takes long (a tiled
        terrain image) calls `interrupt()` between its parts; it raises to stop the job."""

    def preview(self, index: int) -> np.ndarray:
        """The current guess of the clean image `index`, as the final image would look."""

    def result(self, index: int) -> np.ndarray:
        """The finished image `index`: uint8 or uint16, height x width."""


class DiffusionModel(Protocol):
    card: ModelCard
    provenance: Provenance

    def parse_condition(
        self, prompt: str, conditioning: Mapping[str, float], violations: Violations
    ) -> object:
        """The model's conditioning from the request; problems go to `violations`."""

    def estimate_bytes(self, images: int, size: int) -> int:
        """Peak memory a job of `images` at `size` adds while it runs."""

    def start(self, plan: Plan) -> Sampling: ...
