"""Choices benchmark (OpenAI's `n`): one request of n choices, which prefills the prompt
once and decodes the n side by side from its one KV, against n requests of one choice
each (what the gateway sent before SamplingParameters.n), in one run.

On the LLM mesh as loadtest/llm.py runs it, n = 4 sampled choices of 32 tokens, for a
short prompt (below prefill's first fixed cut: n requests share nothing) and a long one
(n requests find all but its last pass in the prefix cache): the time until every choice
has its first token, until every choice is whole, and the prompt tokens prefill computed
(its "prefill" stage's tokens). The two ways alternate round by round, so that drift on a
busy machine hits both alike.

    python -m loadtest.choices --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from grpc import aio

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from loadtest.llm import PORTS, start_mesh, wait_mesh
from loadtest.mesh_overhead import write

BEGIN, END = "<!-- choices:begin -->", "<!-- choices:end -->"
N = 4
NEW_TOKENS = 32
PARAGRAPH = (
    "A mesh of small services serves a language model: the tokenizer turns text into ids, "
    "prefill computes the prompt's cache, decode writes the answer token by token. "
)
PROMPTS = {
    "short": "Write one sentence about the sea:",
    "long": PARAGRAPH * 14 + "Summarise the text above in one sentence:",
}


@dataclass
class Sample:
    all_first_s: float
    all_done_s: float
    prefill_tokens: int


def _sampling(seed: int, n: int = 0) -> sampling_pb2.SamplingParameters:
    return sampling_pb2.SamplingParameters(temperature=0.8, seed=seed, n=n)


def _prefill_tokens(complete: generation_pb2.GenerationComplete) -> int:
    return sum(s.tokens for s in complete.timing.stages if s.name == "prefill")


async def _read(stub, request: generation_pb2.GenerateRequest, started: float, firsts, completes):
    """One stream: when each choice's first token came, and each choice's end."""
    async for message in stub.Generate(request, timeout=300):
        if message.HasField("chunk"):
            if message.chunk.token_ids:
                firsts.setdefault((id(request), message.chunk.index), time.perf_counter() - started)
        else:
            completes.append((time.perf_counter() - started, message.complete))


async def one_request(stub, prompt: str, seed: int) -> Sample:
    stopping = sampling_pb2.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    request = generation_pb2.GenerateRequest(
        prompt=prompt, sampling=_sampling(seed, N), stopping=stopping
    )
    firsts: dict = {}
    completes: list = []
    await _read(stub, request, time.perf_counter(), firsts, completes)
    assert len(firsts) == N and len(completes) == N
    # Every choice reports the one prefill; it ran once.
    return Sample(
        max(firsts.values()), max(t for t, _ in completes), _prefill_tokens(completes[0][1])
    )


async def n_requests(stub, prompt: str, seed: int) -> Sample:
    stopping = sampling_pb2.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [
        generation_pb2.GenerateRequest(
            prompt=prompt, sampling=_sampling(seed + i), stopping=stopping
        )
        for i in range(N)
    ]
    firsts: dict = {}
    completes: list = []
    started = time.perf_counter()
    await asyncio.gather(*(_read(stub, r, started, firsts, completes) for r in requests))
    assert len(firsts) == N and len(completes) == N
    return Sample(
        max(firsts.values()),
        max(t for t, _ in completes),
        sum(_prefill_tokens(complete) for _, complete in completes),
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


async def rows(rounds: int) -> list[str]:
    root = Path(tempfile.mkdtemp(prefix="aimesh-choices-"))
    processes = start_mesh(root)
    try:
        await wait_mesh()
        async with aio.insecure_channel(f"127.0.0.1:{PORTS['generation']}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            table = []
            for name, prompt in PROMPTS.items():
                await one_request(stub, prompt, 0)  # warm, and the long prompt cached
                await n_requests(stub, prompt, 0)
                shared: list[Sample] = []
                apart: list[Sample] = []
                for round_ in range(rounds):
                    shared.append(await one_request(stub, prompt, 100 + round_))
                    apart.append(await n_requests(stub, prompt, 100 + round_))
                for way, samples in (("one request, n = 4", shared), ("4 requests", apart)):
                    first = statistics.median(s.all_first_s for s in samples)
                    done = statistics.median(s.all_done_s for s in samples)
                    tokens = statistics.median(s.prefill_tokens for s in samples)
                    table.append(f"| {name} | {way} | {_ms(first)} | {_ms(done)} | {tokens:.0f} |")
            return table
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def report(table: list[str], command: str) -> str:
    return "\n".join(
        [
            BEGIN,
            "## Choices (`n`): one prefill against n requests",
            "",
            f"`{command}` on {platform.machine()} ({torch.get_num_threads()} threads): "
            f"{N} sampled choices of {NEW_TOKENS} tokens (ignore_eos), medians over rounds, "
            "the two ways alternated. Both ways find the long prompt in the prefix cache "
            "(from the warm-up) up to its last fixed cut and compute the rest: once for "
            "one request, once per request for 4. Timings on a noisy 2-core machine: read "
            "the ratios.",
            "",
            "| prompt | way | every choice's first token (ms) | every choice whole (ms) "
            "| prompt tokens prefill computed |",
            "|---|---|---|---|---|",
            *table,
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    table = asyncio.run(rows(args.rounds))
    markdown = report(table, "python -m loadtest.choices")
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
