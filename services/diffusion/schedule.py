"""DDPM noise schedule and the DDPM/DDIM update rules, shared by training and sampling.

Both samplers may skip training timesteps ("respacing", Nichol & Dhariwal 2021): a run of
N steps visits N evenly spaced timesteps, and each update uses the cumulative alphas of
the two timesteps it moves between, so one trained model serves any N up to T.
"""

from __future__ import annotations

import math

import torch


def cosine_alpha_bars(timesteps: int) -> torch.Tensor:
    """Cumulative signal fractions alpha_bar_t for t = 0..T-1 (cosine schedule, float64).

    The cosine schedule keeps small images from being destroyed in the first few steps,
    which the linear schedule of the original DDPM does to 8x8 digits.
    """
    s = 0.008
    steps = torch.arange(timesteps + 1, dtype=torch.float64) / timesteps
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    alpha_bars = f[1:] / f[0]
    return alpha_bars.clamp(min=1e-5, max=0.9999)


def respaced(timesteps: int, steps: int) -> list[int]:
    """The `steps` training timesteps a sampler visits, from noisiest to cleanest."""
    if not 1 <= steps <= timesteps:
        raise ValueError(f"steps must be 1..{timesteps}, got {steps}")
    if steps == 1:
        return [timesteps - 1]
    return [round((steps - 1 - i) * (timesteps - 1) / (steps - 1)) for i in range(steps)]


def predict_clean(x: torch.Tensor, eps: torch.Tensor, alpha_bar: float) -> torch.Tensor:
    return ((x - math.sqrt(1 - alpha_bar) * eps) / math.sqrt(alpha_bar)).clamp(-1, 1)


def ddim_step(
    x: torch.Tensor, eps: torch.Tensor, alpha_bar: float, alpha_bar_prev: float
) -> torch.Tensor:
    """Deterministic DDIM (eta = 0) move from alpha_bar to alpha_bar_prev."""
    x0 = predict_clean(x, eps, alpha_bar)
    eps = (x - math.sqrt(alpha_bar) * x0) / math.sqrt(1 - alpha_bar)
    return math.sqrt(alpha_bar_prev) * x0 + math.sqrt(1 - alpha_bar_prev) * eps


def ddpm_step(
    x: torch.Tensor, eps: torch.Tensor, alpha_bar: float, alpha_bar_prev: float, noise: torch.Tensor
) -> torch.Tensor:
    """Ancestral DDPM move from alpha_bar to alpha_bar_prev (posterior mean + its variance)."""
    x0 = predict_clean(x, eps, alpha_bar)
    beta = 1 - alpha_bar / alpha_bar_prev
    mean = (
        math.sqrt(alpha_bar_prev) * beta / (1 - alpha_bar) * x0
        + math.sqrt(1 - beta) * (1 - alpha_bar_prev) / (1 - alpha_bar) * x
    )
    variance = beta * (1 - alpha_bar_prev) / (1 - alpha_bar)
    return mean + math.sqrt(variance) * noise
