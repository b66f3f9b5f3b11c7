"""Logprobs benchmark: what asking for them costs, one run.

(a) The sampler alone (services/llm/sampling.py) on a logits row of SmolLM2's 49,152
tokens and of Qwen's 151,936: a greedy and a sampled draw, without alternatives and with
20 (OpenAI's most). (b) The LLM mesh (as loadtest/constrained.py runs it): the
inter-token latency of greedy streams at batch 1 and 16, plain against logprobs with 5
alternatives: the engines' top-k, the alternatives on the wire and the router's token
bytes, rounds alternated so that drift hits both alike.

    python -m loadtest.logprobs --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

import torch

from aimesh.llm.v1 import sampling_pb2
from loadtest.constrained import itl_rows
from loadtest.mesh_overhead import write
from services.llm.sampling import SamplingParams, sample

BEGIN, END = "<!-- logprobs:begin -->", "<!-- logprobs:end -->"
ALTERNATIVES = 5


def _median_us(draw, repeats: int = 400) -> float:
    times = []
    for index in range(repeats):
        started = time.perf_counter()
        draw(index)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def sampler_alone() -> list[str]:
    rows = []
    for vocabulary in (49_152, 151_936):
        logits = torch.randn(vocabulary, generator=torch.Generator().manual_seed(0)) * 4
        for name, params in (
            ("greedy", SamplingParams()),
            ("temperature 0.8", SamplingParams(temperature=0.8, seed=1)),
        ):
            with_top = SamplingParams(**{**params.__dict__, "top_logprobs": 20})
            plain = _median_us(lambda i, p=params, row=logits: sample(row, p, [], i))
            top = _median_us(lambda i, p=with_top, row=logits: sample(row, p, [], i))
            rows.append(f"| {vocabulary:,} | {name} | {plain:.0f} µs | {top:.0f} µs |")
    return rows


def report(sampler_rows: list[str], mesh_rows: list[str], command: str) -> str:
    return "\n".join(
        [
            BEGIN,
            "## Logprobs",
            "",
            f"`{command}` on {platform.machine()} ({torch.get_num_threads()} threads). "
            "(a) one draw of the sampler, median of 400; (b) the mesh's greedy streams, "
            f"plain against `logprobs` with {ALTERNATIVES} alternatives, median over rounds. "
            "Timings on a noisy 2-core machine: read the ratios.",
            "",
            "| vocabulary | draw | no alternatives | 20 alternatives |",
            "|---|---|---|---|",
            *sampler_rows,
            "",
            "| batch | ITL plain (ms) | ITL with logprobs (ms) | cost |",
            "|---|---|---|---|",
            *mesh_rows,
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sampler_rows = sampler_alone()
    print("\n".join(sampler_rows))
    plain = sampling_pb2.SamplingParameters()
    with_logprobs = sampling_pb2.SamplingParameters(logprobs=True, top_logprobs=ALTERNATIVES)
    mesh_rows = asyncio.run(itl_rows(args.rounds, plain, with_logprobs))
    markdown = report(sampler_rows, mesh_rows, "python -m loadtest.logprobs")
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
