"""The LLM engines alone, in this process: what prefill and decode would cost with no mesh
around them, the ceiling the mesh's own numbers are read against.

For each engine (llama.cpp on the Q4_1 GGUF, torch in float32 and bfloat16): a 256-token
prefill, torch prefill's KV written as llama.cpp's state (what llama.cpp decode does at
the handoff), and one decode step over 1 and 16 sequences of a short prompt. Median of
repeated runs after a warm-up, every core.

    python -m loadtest.llm_engines --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from services.llm.artifacts import gguf_path, resolve_model
from services.llm.llama import Llama, LlamaConfig, TorchSlots
from services.llm.llama_cpp import ENGINE_VERSION, LlamaCpp

BEGIN, END = "<!-- llm-engines:begin -->", "<!-- llm-engines:end -->"
PROMPT = [(i * 37) % 40000 + 100 for i in range(256)]
SHORT = PROMPT[:12]
BATCHES = (1, 16)
MAX_LEN = 512


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def steps_ms(decode: Callable[[list[int], list[int], list[int]], object], rows: int) -> float:
    """One decode step of `rows` sequences that each hold SHORT, positions advancing."""
    position = [len(SHORT)]

    def step() -> None:
        decode([5] * rows, [position[0]] * rows, list(range(rows)))
        position[0] += 1

    return median_ms(step, 40)


def llama_cpp_row(config: LlamaConfig, threads: int, torch_kv: list) -> list[str]:
    prefill = LlamaCpp(gguf_path(), config, sequences=1, max_seq_len=MAX_LEN, threads=threads)
    decode = LlamaCpp(
        gguf_path(), config, sequences=max(BATCHES), max_seq_len=MAX_LEN, threads=threads
    )
    try:
        prefill_ms = median_ms(lambda: prefill.prefill(PROMPT), 5)
        written_ms = median_ms(lambda: decode.state_of(torch_kv), 5)
        _, state = prefill.prefill(SHORT)
        cells = []
        for rows in BATCHES:
            for slot in range(rows):
                decode.load(slot, state)
            cells.append(steps_ms(decode.decode, rows))
    finally:
        prefill.close()
        decode.close()
    return [
        f"llama.cpp Q4_1 ({ENGINE_VERSION})",
        f"{prefill_ms:.0f}",
        f"{written_ms:.1f}",
        *_steps(cells),
    ]


def torch_row(model: Llama) -> list[str]:
    prefill_ms = median_ms(lambda: model.prefill(PROMPT), 5)
    _, kv = model.prefill(SHORT)
    cells = []
    for rows in BATCHES:
        slots = TorchSlots(model, rows, MAX_LEN)
        for slot in range(rows):
            slots.load(slot, kv)
        cells.append(steps_ms(slots.decode, rows))
    name = f"torch {str(model.dtype).removeprefix('torch.')}"
    return [name, f"{prefill_ms:.0f}", "-", *_steps(cells)]


def _steps(milliseconds: list[float]) -> list[str]:
    return [
        f"{ms:.1f} ms, {rows / ms * 1e3:.0f} tok/s"
        for rows, ms in zip(BATCHES, milliseconds, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = resolve_model(None, MeshSettings().cache_dir)
    float32 = Llama.load(directory, torch.float32)
    rows = [torch_row(float32), torch_row(Llama.load(directory, torch.bfloat16))]
    _, torch_kv = float32.prefill(PROMPT)
    rows.insert(0, llama_cpp_row(float32.config, args.threads, torch_kv))
    lines = [
        BEGIN,
        "## LLM engines alone: prefill and decode steps in one process",
        "",
        "Command: `python -m loadtest.llm_engines` (part of `make bench-llm-peers`). "
        f"SmolLM2-135M-Instruct, {args.threads} threads, median after a warm-up, no mesh: "
        "the ceiling the mesh rows above are read against. Prefill: a 256-token prompt. "
        "Written as state: torch's KV of that prompt as llama.cpp's sequence state (what "
        "llama.cpp decode does with torch prefill's KV). Steps: one decode step over 1 "
        f"and 16 sequences of a {len(SHORT)}-token prompt. Machine: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, torch "
        f"{torch.__version__}, {torch.backends.cpu.get_cpu_capability()}.",
        "",
        "| engine | prefill 256 ms | written as state ms | step, 1 sequence | step, 16 sequences |",
        "|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in rows),
        END,
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
