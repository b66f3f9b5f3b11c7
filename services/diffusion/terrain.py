"""The terrain model: the pretrained one-step consistency UNet of `adaptive-terrain-diffusion`.

The ONNX file ships in that package; aimesh runs it with its own ONNX Runtime session
(CUDA provider when present) or on Triton Inference Server (denoisers.py), and with its
own sampling loop either way, so that jobs step, cancel and report like every other
model. Native output is 128x128; larger squares are generated as overlapping 128-pixel
views of one noise canvas, blended with a Hann window, as the package does. The model
is endpoint-distilled: one step only (a multistep consistency schedule makes its
heightfields measurably rougher, so it is not offered).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.artifacts import sha256_of
from mesh.failures import NotReady
from mesh.validation import Violations
from services.diffusion.denoisers import Denoiser, OnnxDenoiser
from services.diffusion.engine import ModelCard, Plan, Provenance

# The file the package's wheel RECORD lists; checked at every load.
ONNX_RESOURCE = "weights/terrain_consistency_unet_difficulty100.onnx"
ONNX_SIZE = 45_458_109
ONNX_SHA256 = "95be54b4a39d58320e187a7ec533351c957f16a00be58773c86074828ee67887"

NATIVE = 128
OVERLAP = 32
SIGMA_MAX = 80.0
DIFFICULTIES = 100
# Model space [-1, 1] maps to heights in metres through an asinh curve.
HEIGHT_RANGE_M = 22.16864013671875
ASINH_SCALE = 0.1


def describe(runs_on: str) -> str:
    return (
        f"Pretrained consistency UNet (adaptive-terrain-diffusion) run on {runs_on}: "
        f"heightfields as 16-bit grayscale PNG, 0 = 0 m, 65535 = {HEIGHT_RANGE_M:.2f} m."
    )


CARD = ModelCard(
    name="terrain",
    description=describe(OnnxDenoiser.runs_on),
    conditioning=(
        "conditioning: difficulty, a whole number 1-100 (default 50); the prompt must be empty"
    ),
    sizes=(NATIVE, 256, 512, 1024, 2048),
    max_steps=1,
    default_steps=1,
    max_images=16,
    samplers=(diffusion_pb2.Sampler.SAMPLER_CONSISTENCY,),
    default_guidance=None,
)


def bundled_onnx() -> Path:
    return Path(str(importlib.resources.files("terrain_diffusion").joinpath(ONNX_RESOURCE)))


def verified_onnx() -> Path:
    """The bundled file, checked against its pins at every load."""
    path = bundled_onnx()
    if not path.is_file() or path.stat().st_size != ONNX_SIZE or sha256_of(path) != ONNX_SHA256:
        raise NotReady(
            f"{path} is missing or does not match its pinned size and sha256; "
            "reinstall adaptive-terrain-diffusion==0.4.2"
        )
    return path


class TerrainModel:
    def __init__(
        self, device: str = "auto", threads: int | None = None, denoiser: Denoiser | None = None
    ) -> None:
        """`denoiser`: where the forward passes run (e.g. a TritonDenoiser); by default the
        bundled file on an ONNX Runtime session here, on `device` with `threads`."""
        if denoiser is None:
            denoiser = OnnxDenoiser(verified_onnx(), device, threads)
        self.denoiser = denoiser
        self.card = dataclasses.replace(CARD, description=describe(denoiser.runs_on))
        self.provenance = Provenance(
            sha256=ONNX_SHA256,
            dtype="float32",
            device=denoiser.device,
            engine="onnxruntime" if isinstance(denoiser, OnnxDenoiser) else "triton",
        )

    def parse_condition(
        self, prompt: str, conditioning: Mapping[str, float], violations: Violations
    ) -> int:
        violations.check(
            not prompt.strip(),
            "prompt",
            "the terrain model takes no prompt; set conditioning[difficulty] instead",
        )
        for key in conditioning:
            if key != "difficulty":
                violations.add(f"conditioning[{key}]", "unknown key; the only one is difficulty")
        difficulty = conditioning.get("difficulty", 50.0)
        if violations.in_range(difficulty, "conditioning[difficulty]", 1, DIFFICULTIES):
            violations.check(
                float(difficulty).is_integer(),
                "conditioning[difficulty]",
                f"must be a whole number, got {difficulty}",
            )
        return int(difficulty) if np.isfinite(difficulty) else 50

    def estimate_bytes(self, images: int, size: int) -> int:
        # A pass's workspace (none here when the passes run on Triton), one image's canvas
        # in flight (noise, blended sum, blend weights as float32, the height conversion
        # in float64) and the batch's uint16 heightfields.
        return self.denoiser.workspace_bytes + 28 * size * size + images * 2 * size * size

    def denoise(self, noisy: np.ndarray, difficulty: int) -> np.ndarray:
        rows = len(noisy)
        feeds = {
            "noisy": np.ascontiguousarray(noisy, dtype=np.float32),
            "sigma": np.full(rows, SIGMA_MAX, dtype=np.float32),
            "difficulty": np.full(rows, (difficulty - 1) / (DIFFICULTIES - 1), np.float32),
        }
        return self.denoiser(feeds)

    def start(self, plan: Plan) -> TerrainSampling:
        return TerrainSampling(self, plan)


def tile_starts(length: int) -> list[int]:
    if length <= NATIVE:
        return [0]
    starts = list(range(0, length - NATIVE + 1, NATIVE - OVERLAP))
    if starts[-1] != length - NATIVE:
        starts.append(length - NATIVE)
    return starts


def heights_from_model_space(values: np.ndarray) -> np.ndarray:
    unit = np.clip((values + 1.0) * 0.5, 0.0, 1.0)
    heights = ASINH_SCALE * np.sinh(unit * np.arcsinh(HEIGHT_RANGE_M / ASINH_SCALE))
    heights = np.clip(heights, 0.0, HEIGHT_RANGE_M)
    return heights - heights.min()


class TerrainSampling:
    def __init__(self, model: TerrainModel, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        # Allocated up front: a batch that does not fit fails before any compute.
        self.heights = np.zeros((len(plan.seeds), plan.size, plan.size), np.uint16)

    def advance(self, index: int, interrupt: Callable[[], None]) -> None:
        size = self.plan.size
        rng = np.random.default_rng(self.plan.seeds[index])
        canvas = rng.standard_normal((1, 1, size, size), dtype=np.float32) * np.float32(SIGMA_MAX)
        hann = np.maximum(np.hanning(NATIVE).astype(np.float32), 1e-3)
        blend = np.outer(hann, hann)
        total = np.zeros((size, size), dtype=np.float32)
        weight = np.zeros((size, size), dtype=np.float32)
        for y in tile_starts(size):
            for x in tile_starts(size):
                interrupt()
                view = canvas[:, :, y : y + NATIVE, x : x + NATIVE]
                denoised = self.model.denoise(view, self.plan.condition)[0, 0]
                total[y : y + NATIVE, x : x + NATIVE] += denoised * blend
                weight[y : y + NATIVE, x : x + NATIVE] += blend
        heights = heights_from_model_space(total / weight)
        self.heights[index] = np.rint(heights / HEIGHT_RANGE_M * 65535)

    def preview(self, index: int) -> np.ndarray:
        return self.heights[index]

    def result(self, index: int) -> np.ndarray:
        return self.heights[index]
