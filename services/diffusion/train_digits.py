"""Train the digits DDPM on scikit-learn's `load_digits` and write the shipped checkpoint.

    python -m services.diffusion.train_digits --out services/diffusion/weights/digits

Reproducible: every random draw comes from one seed and torch runs on a fixed thread
count, so the same torch build on the same CPU writes the same weights (other CPUs may
differ in the last bits of float sums). The checkpoint is the EMA of the weights, stored
as fp16 safetensors with a size + sha256 manifest that the service checks at load.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from safetensors.torch import save_file
from sklearn.datasets import load_digits

from mesh.artifacts import write_manifest
from services.diffusion.digits_model import NULL_CLASS, TIMESTEPS, DigitsDenoiser
from services.diffusion.schedule import cosine_alpha_bars

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def digits_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Images scaled from 0..16 to -1..1, flattened to 64, and their labels."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).reshape(-1, 64) / 8 - 1
    return images, torch.tensor(digits.target, dtype=torch.long)


def train(
    out: Annotated[Path, typer.Option(help="directory to write the checkpoint to")],
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 8000,
    batch: int = 256,
    learning_rate: float = 2e-3,
    label_dropout: Annotated[float, typer.Option(help="fraction trained unconditioned")] = 0.1,
    ema_decay: float = 0.999,
    seed: int = 0,
    threads: int = 2,
) -> None:
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    images, labels = digits_dataset()
    alpha_bars = cosine_alpha_bars(TIMESTEPS).float()
    model = DigitsDenoiser()
    ema = DigitsDenoiser()
    ema.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps))
    )
    started = time.perf_counter()
    for step in range(steps):
        index = torch.randint(0, len(images), (batch,))
        x0, label = images[index], labels[index].clone()
        label[torch.rand(batch) < label_dropout] = NULL_CLASS
        t = torch.randint(0, TIMESTEPS, (batch,))
        noise = torch.randn_like(x0)
        a = alpha_bars[t][:, None]
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        loss = torch.nn.functional.mse_loss(model(noisy, t, label), noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for kept, live in zip(ema.parameters(), model.parameters(), strict=True):
                kept.lerp_(live, 1 - ema_decay)
        if step % 1000 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {loss.item():.4f} {time.perf_counter() - started:.0f}s")
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.half().contiguous() for name, tensor in ema.state_dict().items()}
    save_file(weights, str(out / WEIGHTS))
    config = {
        "timesteps": TIMESTEPS,
        "schedule": "cosine",
        "prediction": "epsilon",
        "steps": steps,
        "batch": batch,
        "learning_rate": learning_rate,
        "label_dropout": label_dropout,
        "ema_decay": ema_decay,
        "seed": seed,
        "torch": torch.__version__,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    write_manifest(out, source="python -m services.diffusion.train_digits")
    print(f"wrote {out} in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    typer.run(train)
