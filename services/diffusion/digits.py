"""The digits DDPM: the project's own class-conditional model of scikit-learn's digits."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from aimesh.diffusion.v1 import diffusion_pb2
from mesh.artifacts import manifest_problems, sha256_of
from mesh.failures import NotReady
from mesh.validation import Violations
from services.diffusion import schedule
from services.diffusion.digits_model import IMAGE_SIDE, NULL_CLASS, PIXELS, DigitsDenoiser
from services.diffusion.engine import ModelCard, Plan, Provenance
from services.diffusion.train_digits import CONFIG, WEIGHTS

SHIPPED = Path(__file__).parent / "weights" / "digits"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# A prompt, stripped and lower-cased, to the class it names ("" is any digit).
PROMPT_CLASSES = (
    {"": NULL_CLASS} | {str(d): d for d in range(10)} | {w: d for d, w in enumerate(WORDS)}
)
Sampler = diffusion_pb2.Sampler

CARD = ModelCard(
    name="digits",
    description=(
        "Class-conditional DDPM trained by aimesh on scikit-learn's 8x8 handwritten digits; "
        "grayscale 8-bit PNG."
    ),
    conditioning="prompt: a digit 0-9 or its English word, or empty for any digit",
    sizes=(IMAGE_SIDE,),
    max_steps=200,
    default_steps=50,
    max_images=100,
    samplers=(Sampler.SAMPLER_DDIM, Sampler.SAMPLER_DDPM),
    default_guidance=2.0,
)


def parse_digit(prompt: str) -> int | None:
    """The class a prompt names; NULL_CLASS for an empty prompt; None if it names none."""
    return PROMPT_CLASSES.get(prompt.strip().lower())


class DigitsModel:
    card = CARD

    def __init__(self, directory: Path = SHIPPED, device: str = "cpu") -> None:
        if problems := manifest_problems(directory):
            raise NotReady(f"the digits checkpoint in {directory} is not trustworthy: {problems}")
        self.timesteps = json.loads((directory / CONFIG).read_text())["timesteps"]
        self.network = DigitsDenoiser()
        weights = {k: v.float() for k, v in load_file(str(directory / WEIGHTS)).items()}
        self.network.load_state_dict(weights)
        self.network.eval().to(device)
        self.device = torch.device(device)
        self.provenance = Provenance(
            sha256=sha256_of(directory / WEIGHTS), dtype="float32", device=device, engine="torch"
        )
        self.alpha_bars = schedule.cosine_alpha_bars(self.timesteps).tolist()

    def parse_condition(
        self, prompt: str, conditioning: Mapping[str, float], violations: Violations
    ) -> int:
        digit = parse_digit(prompt)
        violations.check(
            digit is not None,
            "prompt",
            "must be a digit 0-9, its English word (zero..nine), or empty for any digit",
        )
        for key in conditioning:
            violations.add(f"conditioning[{key}]", "the digits model takes no conditioning keys")
        return NULL_CLASS if digit is None else digit

    def estimate_bytes(self, images: int, size: int) -> int:
        # Per image: the state and its generator; per unit: a two-row forward pass.
        return images * (PIXELS * 4 * 4 + 4096) + 4 * 1024 * 1024

    def start(self, plan: Plan) -> DigitsSampling:
        return DigitsSampling(self, plan)


class DigitsSampling:
    def __init__(self, model: DigitsModel, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        self.timesteps = schedule.respaced(model.timesteps, plan.steps)
        self.generators = [torch.Generator().manual_seed(seed) for seed in plan.seeds]
        self.states = [torch.randn(1, PIXELS, generator=g) for g in self.generators]
        self.cleans = [torch.zeros(1, PIXELS) for _ in plan.seeds]
        self.done = [0] * len(plan.seeds)
        guided = plan.condition != NULL_CLASS and plan.guidance not in (None, 1.0)
        labels = [plan.condition, NULL_CLASS] if guided else [plan.condition]
        self.labels = torch.tensor(labels)

    @torch.inference_mode()
    def _noise_estimate(self, x: torch.Tensor, t: int) -> torch.Tensor:
        # States and their generators stay on the CPU (seeded noise is the same on every
        # machine); only the forward pass moves to the model's device.
        rows = len(self.labels)
        device = self.model.device
        eps = self.model.network(
            x.expand(rows, -1).to(device),
            torch.full((rows,), t, device=device),
            self.labels.to(device),
        ).cpu()
        if rows == 1:
            return eps
        conditional, unconditional = eps[0:1], eps[1:2]
        return unconditional + self.plan.guidance * (conditional - unconditional)

    @torch.inference_mode()
    def advance(self, index: int, interrupt: Callable[[], None]) -> None:
        # One step of one 8x8 image is far under a millisecond: nothing to interrupt.
        i = self.done[index]
        t = self.timesteps[i]
        alpha_bar = self.model.alpha_bars[t]
        alpha_bar_prev = (
            self.model.alpha_bars[self.timesteps[i + 1]] if i + 1 < len(self.timesteps) else 1.0
        )
        x = self.states[index]
        eps = self._noise_estimate(x, t)
        self.cleans[index] = schedule.predict_clean(x, eps, alpha_bar)
        if self.plan.sampler == Sampler.SAMPLER_DDPM and alpha_bar_prev < 1.0:
            noise = torch.randn(1, PIXELS, generator=self.generators[index])
            x = schedule.ddpm_step(x, eps, alpha_bar, alpha_bar_prev, noise)
        else:
            x = schedule.ddim_step(x, eps, alpha_bar, alpha_bar_prev)
        self.states[index] = x
        self.done[index] = i + 1

    def _render(self, values: torch.Tensor) -> np.ndarray:
        """[-1, 1] -> 8-bit grayscale."""
        unit = (values.reshape(IMAGE_SIDE, IMAGE_SIDE).numpy().astype(np.float64) + 1.0) / 2.0
        return np.rint(np.clip(unit, 0.0, 1.0) * 255).astype(np.uint8)

    def preview(self, index: int) -> np.ndarray:
        return self._render(self.cleans[index])

    def result(self, index: int) -> np.ndarray:
        return self._render(self.states[index])
