"""The decode step's matrix work, plain `F.linear` against oneDNN-packed weights.

Every projection of SmolLM2-135M-Instruct (QKV, output, gate/up, down per layer, and the
tied output head), run for `rows` sequences at once as one decode step runs them; the two
layouts alternate, best of 5 each, so both see the same machine. This is what
services/llm/linear.py chose its layout by.

    python -m loadtest.llm_kernels --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from services.llm.artifacts import load_state_dict, resolve_model
from services.llm.linear import Projection, packable

BEGIN, END = "<!-- llm-kernels:begin -->", "<!-- llm-kernels:end -->"
ROWS = (1, 4, 16)


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    state = load_state_dict(resolve_model(None, MeshSettings().cache_dir))
    names = [n for n in state if n.endswith("proj.weight")] + ["model.embed_tokens.weight"]
    return [state[name].to(dtype).contiguous() for name in names]


def step_seconds(projections: list[Projection], rows: int, dtype: torch.dtype) -> float:
    inputs = {p.in_features: torch.randn(rows, p.in_features, dtype=dtype) for p in projections}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            started = time.perf_counter()
            for projection in projections:
                projection(inputs[projection.in_features])
            best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        BEGIN,
        "## LLM decode step: matrix kernels",
        "",
        "Command: `python -m loadtest.llm_kernels` (part of `make bench-llm-peers`). "
        f"All projections of SmolLM2-135M-Instruct for one decode step, {args.threads} "
        f"torch threads, best of 5, layouts alternating. Machine: {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}.",
        "",
        "| dtype | rows | `F.linear` ms | oneDNN packed ms | speed-up |",
        "|---|---|---|---|---|",
    ]
    device = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        plain_weights = weights(dtype)
        plain = [Projection(w, packed=False) for w in plain_weights]
        packs = packable(dtype, device)
        packed = [Projection(w, packed=True) for w in plain_weights] if packs else []
        for rows in ROWS:
            step_seconds(plain, rows, dtype)  # warm both before timing
            plain_s = step_seconds(plain, rows, dtype)
            if packed:
                step_seconds(packed, rows, dtype)
                packed_s = step_seconds(packed, rows, dtype)
                cells = f"{packed_s * 1e3:.1f} | {plain_s / packed_s:.2f}x"
            else:
                cells = "not on this CPU (oneDNN bfloat16 needs AVX-512 or AVX-NE-CONVERT) | -"
            lines.append(
                f"| {str(dtype).removeprefix('torch.')} | {rows} | {plain_s * 1e3:.1f} | {cells} |"
            )
    lines.append(END)
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
