"""The digits denoiser: a class-conditional MLP that predicts the noise in an 8x8 digit.

An MLP, not a UNet: at 64 pixels a convolution buys nothing, and a residual MLP of under a
million parameters learns `load_digits` in a few CPU minutes. Class 10 is the "no class"
token that classifier-free guidance needs; training drops the label to it 10% of the time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

IMAGE_SIDE = 8
PIXELS = IMAGE_SIDE * IMAGE_SIDE
CLASSES = 10
NULL_CLASS = CLASSES
TIMESTEPS = 200


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    frequencies = torch.exp(-math.log(10_000) * torch.arange(half, dtype=torch.float32) / half)
    angles = t.float()[:, None] * frequencies[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.linear(nn.functional.silu(self.norm(h)))


class DigitsDenoiser(nn.Module):
    def __init__(self, width: int = 512, depth: int = 3, embedding: int = 128) -> None:
        super().__init__()
        self.embedding = embedding
        self.time = nn.Sequential(
            nn.Linear(embedding, embedding), nn.SiLU(), nn.Linear(embedding, embedding)
        )
        self.label = nn.Embedding(CLASSES + 1, embedding)
        self.pixels_in = nn.Linear(PIXELS, width)
        self.condition_in = nn.Linear(embedding, width)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
        self.out = nn.Sequential(nn.LayerNorm(width), nn.SiLU(), nn.Linear(width, PIXELS))

    def forward(self, x: torch.Tensor, t: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        condition = self.time(timestep_features(t, self.embedding)) + self.label(label)
        h = self.pixels_in(x) + self.condition_in(nn.functional.silu(condition))
        return self.out(self.blocks(h))
