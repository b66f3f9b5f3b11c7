"""Greedy reproducibility benchmark: does a prefix-cache hit change greedy text, and what
do prefill's fixed passes (services/llm/passes.py) cost? One run, in process, on the
default mesh's engines: torch prefill (float32 here) handing its KV to llama.cpp's 4-bit
decode.

(a) For each prompt, greedy text after a whole prefill against after a prefill that
found all but its last token cached (the request repeated: a retry, n choices, a
streamed and a whole answer), with one pass from the hit's end and with fixed passes.
(b) Prefill time of a prompt run whole, in one pass against in fixed passes, at several
lengths (median of rounds, alternated).

    python -m loadtest.reproducibility --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from loadtest.mesh_overhead import write
from mesh.config import MeshSettings
from services.llm.artifacts import gguf_path, load_tokenizer, resolve_model
from services.llm.llama import Llama, LlamaConfig
from services.llm.llama_cpp import LlamaCpp
from services.llm.passes import passes
from services.llm.sampling import SamplingParams
from services.prefill.engine import PrefillEngine
from services.prefill.prefix_cache import PrefixCache

BEGIN, END = "<!-- reproducibility:begin -->", "<!-- reproducibility:end -->"
NEW_TOKENS = 32
QUESTIONS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List the planets of the solar system.",
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and French.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "What is 17 times 23?",
]
SYSTEM = (
    "You are a concise assistant for a documentation site. Answer in at most three "
    "sentences, plainly, and say so when you do not know. "
)


def _greedy(decode: LlamaCpp, prompt: list[int], first: int, kv) -> list[int]:
    decode.load(0, decode.readable(kv))
    tokens = [first]
    try:
        while len(tokens) < NEW_TOKENS:
            position = len(prompt) + len(tokens) - 1
            tokens.append(int(decode.decode([tokens[-1]], [position], [0])[0].argmax()))
    finally:
        decode.free(0)
    return tokens


def differing(model: Llama, decode: LlamaCpp, prompts: list[list[int]], fixed: bool) -> int:
    """How many prompts' greedy text changed when all but the last token was cached."""
    changed = 0
    for prompt in prompts:
        engine = PrefillEngine(model, PrefixCache(1 << 28), fixed_passes=fixed)
        whole = engine.run(prompt, SamplingParams())
        again = engine.run(prompt, SamplingParams())
        before = _greedy(decode, prompt, whole.first_token, whole.kv)
        after = _greedy(decode, prompt, again.first_token, again.kv)
        changed += before != after
    return changed


def prefill_times(model: Llama, ids: list[int], rounds: int) -> list[str]:
    rows = []
    for length in (64, 256, 1024, 2000):
        prompt = ids[:length]
        one, fixed = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            model.prefill(prompt)
            one.append(time.perf_counter() - started)
            started = time.perf_counter()
            model.prefill(prompt, cuts=passes(0, length))
            fixed.append(time.perf_counter() - started)
        one_s, fixed_s = statistics.median(one), statistics.median(fixed)
        rows.append(
            f"| {length} | {len(passes(0, length))} | {one_s * 1e3:.0f} | {fixed_s * 1e3:.0f} | "
            f"{(fixed_s / one_s - 1) * 100:+.1f}% |"
        )
    return rows


def report(counts: tuple[int, int, int], rows: list[str], command: str) -> str:
    total, free, fixed = counts
    return "\n".join(
        [
            BEGIN,
            "## Greedy reproducibility",
            "",
            f"`{command}` on {platform.machine()} ({torch.get_num_threads()} threads): the "
            "default mesh's engines in process, torch prefill (float32) handing its KV to "
            "llama.cpp's 4-bit decode. A prompt is a chat question after a shared system "
            f"prompt; greedy text is {NEW_TOKENS} tokens.",
            "",
            "| prefill after a hit of all but the last token | prompts whose greedy text changed |",
            "|---|---|",
            f"| one pass from the hit's end (`fixed_passes = false`) | {free} of {total} |",
            f"| fixed passes (the default) | {fixed} of {total} |",
            "",
            "What the fixed passes cost a prompt run whole (no hit), median of rounds:",
            "",
            "| prompt tokens | passes | one pass (ms) | fixed passes (ms) | cost |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "A hit is used up to the last cut it covers (every 64 tokens to 256, then every "
            "256), so a repeated prompt recomputes up to 63 (255 past 256) tokens that one "
            "pass would have reused. Decode is bit-exact per sequence whatever the batch "
            "(llama.cpp: a KV stream per sequence; tests/services/llm/test_engine.py), and "
            "the sampler's seeds depend on nothing but (seed, step).",
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    directory = resolve_model(None, MeshSettings().cache_dir)
    tokenizer = load_tokenizer(directory)
    model = Llama.load(directory)
    decode = LlamaCpp(
        gguf_path(),
        LlamaConfig.from_directory(directory),
        sequences=1,
        max_seq_len=2048,
        threads=torch.get_num_threads(),
    )
    try:
        prompts = [
            tokenizer.encode(
                f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}"
                "<|im_end|>\n<|im_start|>assistant\n"
            ).ids
            for question in QUESTIONS
        ]
        counts = (
            len(prompts),
            differing(model, decode, prompts, fixed=False),
            differing(model, decode, prompts, fixed=True),
        )
        print(counts)
        text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
        rows = prefill_times(model, tokenizer.encode(text).ids, args.rounds)
    finally:
        decode.close()
    markdown = report(counts, rows, "python -m loadtest.reproducibility")
    print(markdown)
    if args.out:
        write(markdown, args.out)


if __name__ == "__main__":
    main()
